"""A safetensors file's data section read straight to a GPU: large reads into page-aligned staging
blocks, several in flight, each block's host-to-device copy overlapped with the next reads.

Why not map the file and copy: a mapped file reaches the GPU only after a CPU copy out of the
mapping (page faults as it goes) and then the DMA; ATOM measured mapped reads at half of
``O_DIRECT`` (3.2 against 6.06 GB/s). Here the file's bytes land once, by the read itself, in
pinned memory the DMA engine copies from, and a few reader threads keep the storage busy while
the copies run (``os.preadv`` and the event waits release the GIL). With ``direct`` the reads
bypass the page cache (``O_DIRECT``: whole aligned blocks into aligned memory), which is what a
350 GiB load wants; where the filesystem refuses it (tmpfs, some network mounts) the same reads
go through the page cache.

The device buffer holds the data section only (torch's allocation, so every tensor view keeps
its offset's alignment within the section); the reads start at the aligned block holding the
section's first byte, so any safetensors file reads with ``O_DIRECT``. (prep's own files start
their data on a 4 KiB boundary, so there that block holds no header bytes.)

The same code runs on the CPU (a plain tensor as the target, unpinned staging), which is how the
block arithmetic, the fallbacks and the error paths are tested without a GPU.

Where storage is out of the way (the files in the page cache or on a RAM-backed folder), the
reads are the CPU's copies out of the page cache, so they are spread over more threads
(:data:`CACHED_READERS`). Measured on H100 hosts (docs/BENCHMARKS.md, "Rank files to the GPU"):
16 threads copy memory at 0.61-0.81 of pinned host-to-device bandwidth, the ceiling of any
loader that copies; registering the page cache with the CUDA driver to copy with no CPU copy ran at
0.10-0.14 of it (pinning the pages costs more than copying them), so it is not done.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import errno
import mmap
import os

import torch

from .safetensors_file import DIRECT_ALIGN, SafetensorsFile, SafetensorsFileError

__all__ = [
    "BLOCK_BYTES", "READERS", "CACHED_READERS", "read_section", "read_to_device",
]

# Measured on the H200 host (docs/BENCHMARKS.md, "Rank files to the GPU"): the defaults below;
# PREP_LOAD_READERS and PREP_LOAD_BLOCK_MIB override them (storage with other needs).
BLOCK_BYTES = 16 << 20
READERS = 8
# Reads through the page cache (a RAM-backed folder, a filesystem that refuses O_DIRECT, direct
# off) are CPU copies, which more threads share out: one rank of 4.91 GiB from /dev/shm, GB/s at
# 8 / 16 / 32 / 48 readers: 11.6 / 19.2 / 22.7 / - on one H100 host, 24.4 / 29.3 / - / 24.4 on
# another, 27.1 / 30.2 / - / - on the H200 host (fastsafetensors 24.3, 23.5, 24.5).
CACHED_READERS = 16


def _setting(name: str, default: int, unit: int = 1) -> int:
    try:
        return max(1, min(64, int(os.environ[name]))) * unit
    except (KeyError, ValueError):
        return default


class _Refused(Exception):
    """O_DIRECT was taken at open but refused at read (EINVAL): read through the page cache."""


def _staging(n: int, nbytes: int, pinned: bool) -> list[torch.Tensor]:
    """``n`` page-aligned blocks of ``nbytes``: pinned (the DMA engine copies from them without a
    bounce of its own) or, for a CPU target, anonymous mappings."""
    blocks = []
    for _ in range(n):
        if pinned:  # cudaHostAlloc gives whole pages; padded only if an allocator ever does not
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            if t.data_ptr() % DIRECT_ALIGN:
                t = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=True)
                t = t[-t.data_ptr() % DIRECT_ALIGN:][:nbytes]
            blocks.append(t)
        else:
            blocks.append(torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8))
    return blocks


def read_section(sf: SafetensorsFile, out: torch.Tensor, *, direct: bool = True, readers: int | None = None,
                 block: int | None = None) -> str:
    """Read ``sf``'s data section into ``out`` (uint8, ``sf.data_size`` bytes, on a CUDA device or
    the CPU) through ``readers`` staging blocks of ``block`` bytes (by default :data:`READERS`
    for ``O_DIRECT`` reads, :data:`CACHED_READERS` through the page cache to a GPU). Returns how
    it read: ``"direct"`` or ``"buffered"``."""
    if out.numel() != sf.data_size or out.dtype != torch.uint8:
        raise ValueError(f"read_section: out is {out.dtype} x {out.numel()}, wants uint8 x {sf.data_size}")
    cached = readers or _setting("PREP_LOAD_READERS", CACHED_READERS if out.device.type == "cuda" else READERS)
    readers = readers or _setting("PREP_LOAD_READERS", READERS)
    block = block or _setting("PREP_LOAD_BLOCK_MIB", BLOCK_BYTES, 1 << 20)
    block = max(DIRECT_ALIGN, block // DIRECT_ALIGN * DIRECT_ALIGN)
    fd = sf.direct_fd() if direct else None
    try:
        if fd is not None:
            try:
                _read(sf, fd, out, readers, block, aligned=True)
                return "direct"
            except _Refused:
                pass
        _read(sf, sf.fd, out, cached, block, aligned=False)
        return "buffered"
    finally:
        if fd is not None:
            os.close(fd)


def _read(sf: SafetensorsFile, fd: int, out: torch.Tensor, readers: int, block: int, aligned: bool) -> None:
    size = os.fstat(fd).st_size
    if size != sf.data_offset + sf.data_size:
        raise SafetensorsFileError(f"{sf.path}: file is {size} bytes, {sf.data_offset + sf.data_size} when its header "
                                   "was read; it changed while being loaded: load it again")
    # Block i holds file bytes [first + i*block, first + (i+1)*block); O_DIRECT needs ``first``
    # aligned, a plain read starts at the section itself.
    first = sf.data_offset // DIRECT_ALIGN * DIRECT_ALIGN if aligned else sf.data_offset
    spans = [(s, min(size, s + block)) for s in range(first, size, block)]
    cuda = out.device.type == "cuda"
    stages = _staging(min(readers, len(spans)) or 1, block, pinned=cuda)
    stream = torch.cuda.current_stream(out.device) if cuda else None
    copied: list[torch.cuda.Event | None] = [None] * len(stages)

    def read(i: int, k: int, wait: "torch.cuda.Event | None") -> None:
        if wait is not None:
            wait.synchronize()  # stage k's last copy to the device has finished
        start, stop = spans[i]
        view = memoryview(stages[k].numpy())
        want = stop - start
        ask = -(-want // DIRECT_ALIGN) * DIRECT_ALIGN if aligned else want  # whole blocks for O_DIRECT
        done = 0
        while done < want:
            try:
                got = os.preadv(fd, [view[done:ask]], start + done)
            except OSError as e:
                if aligned and e.errno == errno.EINVAL:
                    raise _Refused from None
                raise SafetensorsFileError(f"{sf.path}: could not be read ({e.strerror}); check the disk") from None
            if got <= 0:
                raise SafetensorsFileError(f"{sf.path}: short read; the file changed or is truncated: load it again")
            done += got

    with cf.ThreadPoolExecutor(len(stages), thread_name_prefix="prep-load") as pool:
        pending: collections.deque[cf.Future] = collections.deque(
            pool.submit(read, i, i, None) for i in range(len(stages)))
        try:
            for i, (start, stop) in enumerate(spans):
                k = i % len(stages)
                pending.popleft().result()
                lo = max(start, sf.data_offset)
                src = stages[k][lo - start:stop - start]
                dst = out[lo - sf.data_offset:stop - sf.data_offset]
                if cuda:
                    dst.copy_(src, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    copied[k] = ev
                else:
                    dst.copy_(src)
                if i + len(stages) < len(spans):
                    pending.append(pool.submit(read, i + len(stages), k, copied[k]))
        finally:
            for f in pending:  # an error above: let queued reads go, the running ones finish
                f.cancel()
    if cuda:
        stream.synchronize()  # the stages are reused by the next file


def read_to_device(sf: SafetensorsFile, device: torch.device, *, direct: bool = True, readers: int | None = None,
                   block: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``sf``'s data section on ``device`` (:func:`read_section`) and every tensor as a view of it."""
    out = torch.empty(sf.data_size, dtype=torch.uint8, device=device)
    if sf.data_size:
        read_section(sf, out, direct=direct, readers=readers, block=block)
    return out, sf.views(out)
