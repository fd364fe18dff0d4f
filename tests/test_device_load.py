"""The staged reader behind ``load_rank(..., "cuda")`` (layouts.device_load), run on the CPU: the
same block arithmetic, reader threads, O_DIRECT alignment and fallbacks, with a CPU tensor as
the target instead of the GPU (only the pinning and the DMA copy differ there)."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from safetensors.torch import save_file

from layouts.device_load import read_section, read_to_device
from layouts.safetensors_file import DIRECT_ALIGN, SafetensorsFile, SafetensorsFileError


def _write(path: pathlib.Path, sizes: list[int], seed: int = 0, pad_header_to: int | None = None) -> pathlib.Path:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for i, n in enumerate(sizes)}
    tensors["f"] = torch.randn(3, 5, generator=g)
    if pad_header_to is None:
        save_file(tensors, path)
        return path
    # The same tensors with the header padded by spaces (valid safetensors) to put the data
    # section at an aligned offset.
    save_file(tensors, path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    pad = -(8 + n) % pad_header_to
    path.write_bytes((n + pad).to_bytes(8, "little") + raw[8:8 + n] + b" " * pad + raw[8 + n:])
    return path


def _section(path: pathlib.Path) -> bytes:
    raw = path.read_bytes()
    return raw[8 + int.from_bytes(raw[:8], "little"):]


def _direct_works(folder: pathlib.Path) -> bool:
    probe = folder / "probe"
    probe.write_bytes(b"\0" * DIRECT_ALIGN)
    try:
        os.close(os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
        return hasattr(os, "O_DIRECT")
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.mark.parametrize("block", [DIRECT_ALIGN, 3 * DIRECT_ALIGN + 1, 1 << 20])
@pytest.mark.parametrize("readers", [1, 3, 8])
@pytest.mark.parametrize("pad", [None, DIRECT_ALIGN], ids=["section-unaligned", "section-aligned"])
def test_staged_read_gives_the_data_section_byte_for_byte(tmp_path, block, readers, pad):
    path = _write(tmp_path / "a.safetensors", [1, 4095, 4096, 70_001, 300_000], pad_header_to=pad)
    sf = SafetensorsFile(path)
    assert (sf.data_offset % DIRECT_ALIGN == 0) == (pad is not None)
    for direct in (True, False):
        out = torch.full((sf.data_size,), 7, dtype=torch.uint8)
        how = read_section(sf, out, direct=direct, readers=readers, block=block)
        assert bytes(out.numpy()) == _section(path)
        assert how == ("direct" if direct and _direct_works(tmp_path) else "buffered")


def test_views_of_the_staged_buffer_are_the_files_tensors(tmp_path):
    from safetensors.torch import load_file

    path = _write(tmp_path / "a.safetensors", [5, 12_345, 8192], seed=3)
    buf, views = read_to_device(SafetensorsFile(path), torch.device("cpu"), block=DIRECT_ALIGN, readers=2)
    want = load_file(path)
    assert views.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(views[name], t), name
        assert views[name].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_a_filesystem_refusing_o_direct_reads_is_read_through_the_page_cache(tmp_path, monkeypatch):
    # Some filesystems take an O_DIRECT open and refuse its reads with EINVAL (older tmpfs, some
    # network mounts; a kernel's tmpfs here may accept it): such reads are refused here.
    import fcntl

    import layouts.device_load as dl

    path = _write(tmp_path / "a.safetensors", [100_000, 3])
    real = os.preadv
    refused = []

    def preadv(fd, bufs, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(fd)
            raise OSError(22, "Invalid argument")
        return real(fd, bufs, offset)

    monkeypatch.setattr(dl.os, "preadv", preadv)
    sf = SafetensorsFile(path)
    out = torch.empty(sf.data_size, dtype=torch.uint8)
    assert read_section(sf, out, direct=True, block=DIRECT_ALIGN) == "buffered"
    assert bytes(out.numpy()) == _section(path)
    assert refused or not _direct_works(tmp_path)


def test_a_file_that_changed_after_its_header_was_read_is_refused(tmp_path):
    path = _write(tmp_path / "a.safetensors", [50_000])
    sf = SafetensorsFile(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(SafetensorsFileError, match="changed while being loaded"):
        read_section(sf, torch.empty(sf.data_size, dtype=torch.uint8))


def test_a_target_of_the_wrong_size_is_refused(tmp_path):
    sf = SafetensorsFile(_write(tmp_path / "a.safetensors", [10]))
    with pytest.raises(ValueError, match="wants uint8"):
        read_section(sf, torch.empty(sf.data_size + 1, dtype=torch.uint8))
