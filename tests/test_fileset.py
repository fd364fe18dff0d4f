"""The TP ranks' files are written together, each source byte read once (prep/siblings.py): the
bytes must be exactly those of each rank's file built alone, for every layout, TP and EP, both
variants (R1-0528's BF16 MTP experts and o_proj take the shared-reads path, MXFP4 experts the
stacked one), with blocks of a few experts and with whole layers."""

from __future__ import annotations

import pathlib

import pytest

import prep.convert as pc
import prep.siblings as siblings
from prep.convert import convert
from prep.deepseek import target_for
from prep.testing import SynthSpec
from checkpoints import write_checkpoint
from layouts.engines import get_engine

ATOM = get_engine("atom")  # the engine whose profile these tests use


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    out = {v: write_checkpoint(SynthSpec(variant=v, n_routed_experts=16), root / v) for v in ("r1-0528", "v2")}
    # Experts wide enough that no rank's part is padded (CK pads each rank's intermediate to
    # 256 rows): their weights are transformed window by window straight into the output.
    out["v2-wide"] = write_checkpoint(SynthSpec(variant="v2", n_routed_experts=8, moe_intermediate_size=512),
                                      root / "v2-wide")
    return out


def files(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".safetensors"}


@pytest.mark.parametrize("variant, layout, moe_layout, tp, ep, chunk", [
    ("r1-0528", "preshuffle", "ck", 2, 1, 64 << 10),
    ("r1-0528", "preshuffle", "ck", 4, 1, 0),
    ("v2", "preshuffle", "ck", 4, 1, 64 << 10),
    ("v2", "non-shuffle", "triton", 2, 1, 64 << 10),
    ("r1-0528", "non-shuffle", "triton", 4, 1, 32 << 20),
    ("v2", "preshuffle", "ck", 4, 4, 64 << 10),
    ("r1-0528", "preshuffle", "ck", 2, 2, 64 << 10),
    ("v2", "preshuffle", "triton-gfx942", 2, 1, 64 << 10),
    ("v2-wide", "preshuffle", "ck", 2, 1, 64 << 10),
    ("v2-wide", "non-shuffle", "triton", 2, 1, 0),
])
def test_files_written_together_hold_the_bytes_of_each_file_written_alone(sources, tmp_path, monkeypatch, variant,
                                                                           layout, moe_layout, tp, ep, chunk):
    monkeypatch.setattr(pc, "CHUNK_BYTES", chunk)
    target = target_for(ATOM, layout=layout, moe_layout=moe_layout, tp=tp, ep=ep)
    seen = []
    real = pc._file_sets

    def spy(jobs):
        sets = real(jobs)
        seen.append([len(s) for s in sets])
        return sets

    monkeypatch.setattr(pc, "_file_sets", spy)
    fills = []
    real_fills = siblings._fills_rows
    monkeypatch.setattr(siblings, "_fills_rows", lambda *a: fills.append(real_fills(*a)) or fills[-1])
    convert(str(sources[variant]), tmp_path / "together", target)
    assert max(seen[0]) == tp  # the ranks' files did go together
    # The wide experts take the window-by-window path for both weight outputs, the narrow ones
    # (padded per rank) the copy of each window into a padded block.
    assert (fills and all(fills)) if variant == "v2-wide" else not any(fills)
    monkeypatch.setattr(pc, "_file_sets", lambda jobs: [[j] for j in jobs])
    convert(str(sources[variant]), tmp_path / "alone", target)
    together, alone = files(tmp_path / "together"), files(tmp_path / "alone")
    assert together.keys() == alone.keys() and len(together) > tp
    for name in alone:
        assert together[name] == alone[name], name
