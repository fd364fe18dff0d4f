"""docs/img/*.svg are what scripts/draw_layouts.py draws from the layouts' transforms today."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

import layouts.shuffle as sh

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def draw():
    spec = importlib.util.spec_from_file_location("draw_layouts", ROOT / "scripts" / "draw_layouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_drawings_are_what_the_transforms_draw(draw, tmp_path):
    assert draw.main([str(tmp_path)]) == 0
    for name in draw.DRAWINGS:
        committed = ROOT / "docs" / "img" / name
        assert committed.read_text() == (tmp_path / name).read_text(), (
            f"docs/img/{name} differs from what the layouts draw now: run .venv/bin/python scripts/draw_layouts.py")


def test_the_drawings_come_from_the_transforms(draw, monkeypatch):
    # A changed permutation changes the picture: the script draws what the transform does.
    w16, s32 = draw.draw_w16(), draw.draw_s32x8()
    real_w, real_s = sh._w16, sh._s32x8_scale  # what the layouts' transforms run, their shapes checked
    monkeypatch.setattr(sh, "_w16", lambda w, out=None: real_w(w.flip(0)).flip(0))
    monkeypatch.setattr(sh, "_s32x8_scale",
                        lambda s, pad_value=0, pad_rows=True: real_s(s, pad_value, pad_rows).flip(1))
    assert draw.draw_w16() != w16 and draw.draw_s32x8() != s32


def test_a_trace_reads_each_stored_byte_back_to_its_source(draw):
    import torch

    def swap(t):  # a known permutation: the two rows swap
        return t.flip(0)

    assert draw.trace(swap, (2, 300)).tolist() == list(range(300, 600)) + list(range(300))
    pad = draw.trace(lambda t: torch.nn.functional.pad(t, (0, 1)), (1, 3)).tolist()
    assert pad == [0, 1, 2, -1]
