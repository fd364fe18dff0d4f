"""An engine loading a rank while `prep convert --force` replaces the folder (it swaps a whole new
folder into place, the old one aside, then deletes it): `load_rank` returns the bytes of one
checkpoint under that checkpoint's manifest, or raises; never a mix of the two (issue 25, item 3:
9 loads mixing tensors and 17 returning one checkpoint's bytes under the other's manifest, over
~40,000 loads against 89 swaps, before loads read every file through the folder as opened)."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest
import torch

import layouts
import layouts.loader
from layouts import ManifestError
from layouts.engines import get_engine
from prep.convert import convert
from prep.deepseek import target_for
from prep.testing import SynthSpec
from checkpoints import write_checkpoint

ATOM = get_engine("atom")  # the engine whose profile these tests use


@pytest.fixture(scope="module")
def generations(tmp_path_factory):
    """Two different conversions (other weights), kept pristine: each test copies them."""
    root = tmp_path_factory.mktemp("swap")
    for name, seed in (("A", 1), ("B", 2)):
        src = write_checkpoint(SynthSpec(seed=seed), root / f"src-{name}")
        convert(str(src), root / name, target_for(ATOM, tp=2))
    return root


@pytest.fixture
def live(generations, tmp_path):
    """OUT holding A, and B ready to be swapped in."""
    shutil.copytree(generations / "A", tmp_path / "out")
    shutil.copytree(generations / "B", tmp_path / "new")
    return tmp_path / "out", tmp_path / "new"


def swap(out: pathlib.Path, new: pathlib.Path) -> pathlib.Path:
    """What prep's commit does to OUT: the new folder renamed into place, the old one set aside."""
    aside = out.with_name(out.name + ".old")
    os.rename(out, aside)
    os.rename(new, out)
    return aside


def _swapping_before_the_first_file(monkeypatch, action):
    read = layouts.loader._load_file
    done = []

    def load_file(*args, **kwargs):
        if not done:
            done.append(action())
        return read(*args, **kwargs)

    monkeypatch.setattr(layouts.loader, "_load_file", load_file)


def test_a_folder_swapped_during_a_load_is_an_error_and_every_file_came_from_the_folder_as_opened(
        live, generations, monkeypatch):
    out, new = live
    _swapping_before_the_first_file(monkeypatch, lambda: swap(out, new))
    with pytest.raises(ManifestError, match=f"^{out}: replaced or removed while it was being loaded .* load it again"):
        layouts.load_rank(out, 1)
    # What was read before that refusal: the rank of the folder as it was opened (A, its manifest's
    # hashes), not B's files swapped in after the manifest was read.
    shutil.rmtree(out)
    shutil.rmtree(out.with_name(out.name + ".old"))
    shutil.copytree(generations / "A", out)
    shutil.copytree(generations / "B", new)
    monkeypatch.setattr(layouts.loader.PinnedFolder, "check", lambda self: None)
    want = layouts.load_rank(generations / "A", 1)
    _swapping_before_the_first_file(monkeypatch, lambda: swap(out, new))
    got = layouts.load_rank(out, 1, verify_hashes=True)  # every tensor checked against the manifest's hash
    assert got.manifest.sha256 == want.manifest.sha256 != layouts.load_manifest(out).sha256  # OUT is B now
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_a_folder_swapped_and_deleted_while_loading_is_an_error_naming_the_cause(live, monkeypatch):
    out, new = live
    _swapping_before_the_first_file(monkeypatch, lambda: shutil.rmtree(swap(out, new)))
    with pytest.raises(ManifestError, match=f"^{out}: replaced or removed while it was being loaded .* load it again"):
        layouts.load_rank(out, 0)


def test_a_manifest_read_before_a_swap_does_not_load_the_new_folders_files(live):
    out, new = live
    manifest = layouts.load_manifest(out)
    swap(out, new)
    with pytest.raises(ManifestError, match="no longer seals the manifest read before .* load it again"):
        layouts.load_rank(out, 0, manifest=manifest)
    assert layouts.load_rank(out, 0).manifest.sha256 != manifest.sha256  # loading again reads the new one


def test_a_load_straddling_a_swap_by_file_is_refused_at_the_end(live, generations):
    # iter_rank_files (a rank file at a time, as the ATOM adapter reads them): a swap between files
    # is refused once the rank is read, though every file read came from the folder as opened.
    out, new = live
    parts = layouts.iter_rank_files(out, 0)
    first = next(parts)
    want = layouts.load_rank(generations / "A", 0)
    assert all(torch.equal(first[n], want[n]) for n in first)
    swap(out, new)
    with pytest.raises(ManifestError, match="replaced or removed while it was being loaded"):
        list(parts)


def test_loads_looping_against_forced_conversions_never_mix(generations, tmp_path):
    # The repro, bounded: `prep convert --force` alternating two sources into OUT in a
    # thread, loads of rank 0 in a loop here. Each load is one generation's bytes, verified against
    # that generation's hashes and equal to its reference, or the one "replaced" error. (Short: it
    # does not catch the loader before the fix in its ~80 loads, as the issue needed ~40,000; the
    # tests above put the swap inside the load and do.)
    import threading
    import time

    from prep.convert import convert as run

    out = tmp_path / "out"
    shutil.copytree(generations / "A", out)
    want = {g: layouts.load_rank(generations / g, 0) for g in "AB"}
    by_sha = {want[g].manifest.sha256: want[g] for g in "AB"}
    stop, swaps, errors = threading.Event(), [], []

    def convert_forever():
        try:
            while not stop.is_set() and len(swaps) < 12:
                g = "B" if len(swaps) % 2 == 0 else "A"
                run(str(generations / f"src-{g}"), out, target_for(ATOM, tp=2), force=True)
                swaps.append(g)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    worker = threading.Thread(target=convert_forever)
    worker.start()
    loads, refused, deadline = 0, 0, time.monotonic() + 60
    try:
        while worker.is_alive() and time.monotonic() < deadline:
            try:
                got = layouts.load_rank(out, 0, verify_hashes=True)
            except ManifestError as e:
                assert "replaced or removed while it was being loaded" in str(e) or "no such folder" in str(e) \
                    or "no prep-manifest.json" in str(e) or "no prep-complete.json" in str(e), str(e)
                refused += 1
                continue
            ref = by_sha[got.manifest.sha256]
            assert all(torch.equal(got[n], ref[n]) for n in ref)
            loads += 1
    finally:
        stop.set()
        worker.join()
    assert not errors and len(swaps) >= 4 and loads > 0, (errors, swaps, loads, refused)
