"""The S32x8 pad byte (issue 14, item 2): what prep writes, what the manifest records, what verify
and revert do with checkpoints of either byte, and what ATOM's profile accepts.

Layout version 2 (preshuffle, ck, triton) pads S32x8 scales with 0x00; version 1 padded with
0x7F. An "old" checkpoint here is written by this prep with the registry's preshuffle layout put
back to version 1 (0x7F): the same code path the old prep ran, so its bytes and manifest are what
an old conversion holds. The kernels' evidence for the byte: tests/test_consumer_kernels.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file

import layouts
from layouts import CompatibilityError, EngineConfig, check_compatibility, load_manifest
from layouts import registry, transforms
from layouts.engines import get_engine
from prep.convert import convert
from prep.deepseek import target_for
from prep.errors import PrepError
from prep.revert import revert
from prep.testing import SynthSpec
from checkpoints import write_checkpoint
from prep.verify import verify

ATOM = get_engine("atom")  # the engine whose profile these tests use

DOWN = "model.layers.0.mlp.down_proj"  # r1-0528's first, dense layer: K = intermediate_size
V1_PRESHUFFLE = dataclasses.replace(registry.PRESHUFFLE, version=1,
                                    scale=transforms.ScaleShuffle(pad_value=registry.LEGACY_S32X8_PAD))


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> pathlib.Path:
    """r1-0528 with intermediate_size = 1152: down_proj has K/32 = 36 scale columns, padded to 40
    (DeepSeek's down_proj at TP 16)."""
    return write_checkpoint(SynthSpec(variant="r1-0528", intermediate_size=1152),
                            tmp_path_factory.mktemp("pad") / "src")


def convert_as(src: pathlib.Path, out: pathlib.Path, layout: registry.Layout | None = None, **spec) -> pathlib.Path:
    """Convert ``src`` to preshuffle at TP 1, with ``layout`` registered as "preshuffle" meanwhile."""
    saved = registry._REGISTRY["preshuffle"]
    registry._REGISTRY["preshuffle"] = layout or saved
    try:
        convert(str(src), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=1, **spec))
    finally:
        registry._REGISTRY["preshuffle"] = saved
    return out


@pytest.fixture(scope="module")
def new(src, tmp_path_factory) -> pathlib.Path:
    return convert_as(src, tmp_path_factory.mktemp("pad") / "new")


@pytest.fixture(scope="module")
def old(src, tmp_path_factory) -> pathlib.Path:
    return convert_as(src, tmp_path_factory.mktemp("pad") / "old", V1_PRESHUFFLE)


def pad_bytes(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The stored S32x8 bytes no logical scale lands on: the buffer unshuffled with its pad kept."""
    full = layouts.shuffle.unshuffle_scale(scale, *scale.shape).view(torch.uint8)
    return torch.cat([full[rows:].reshape(-1), full[:rows, cols:].reshape(-1)])


def stored_scale(out: pathlib.Path) -> torch.Tensor:
    return layouts.load_rank(out, 0)[f"{DOWN}.weight_scale"]


def edit_manifest(out: pathlib.Path, fn) -> None:
    """Rewrite the manifest and keep the completion marker's hash in step (a crafted folder)."""
    m = json.loads((out / "prep-manifest.json").read_text())
    fn(m)
    data = json.dumps(m, separators=(",", ":")).encode()
    (out / "prep-manifest.json").write_bytes(data)
    marker = json.loads((out / "prep-complete.json").read_text())
    marker["manifest_sha256"] = hashlib.sha256(data).hexdigest()
    (out / "prep-complete.json").write_text(json.dumps(marker))


def copy_of(out: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    import shutil

    shutil.copytree(out, dest)
    return dest


def same_tensors(a: pathlib.Path, b: pathlib.Path) -> None:
    def load(d):
        t = {}
        for f in sorted(d.glob("*.safetensors")):
            t.update(load_file(f))
        return t

    want, got = load(a), load(b)
    assert want.keys() == got.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


# ------------------------------------------------------------------------------ what prep writes
def test_s32x8_scales_are_padded_with_zero_bytes(new):
    s = stored_scale(new)
    assert tuple(s.shape) == (256, 40)  # N = 256 rows; 36 scale columns padded to 40
    pad = pad_bytes(s, 256, 36)
    assert pad.numel() == 256 * 4 and bool((pad == 0x00).all())
    rec = load_manifest(new).layouts["preshuffle"].to_json()
    assert rec["version"] == 2 and rec["scale_transform"]["pad_value"] == 0x00


def test_every_padding_scale_transform_pads_with_zero_bytes():
    s = torch.randint(0, 255, (300, 13), dtype=torch.uint8)
    for layout in ("preshuffle", "ck"):
        assert layouts.get_layout(layout).scale.pad_value == 0x00
        assert bool((pad_bytes(layouts.get_layout(layout).scale.forward(s), 300, 13) == 0).all())
    triton = layouts.get_layout("triton")  # triton_kernels' CDNA4_SCALE swizzle pads with zeros too
    e = torch.randint(0, 255, (2, 32, 4), dtype=torch.uint8)
    full = layouts.shuffle.unshuffle_scale_per_expert(triton.scale.forward(e), 8)
    assert torch.equal(full[..., :4], e) and bool((full[..., 4:] == 0).all())
    assert [layouts.get_layout(n).version for n in ("preshuffle", "ck", "triton")] == [2, 2, 2]


# ------------------------------------------------------------------------------ old checkpoints
def test_an_old_checkpoint_keeps_its_0x7f_pad_and_records_it(old):
    assert bool((pad_bytes(stored_scale(old), 256, 36) == 0x7F).all())
    rec = load_manifest(old).layouts["preshuffle"]
    assert rec.version == 1 and rec.scale_transform["pad_value"] == 0x7F
    assert registry.recorded_layout(rec).scale.pad_value == 0x7F


@pytest.mark.parametrize("which", ["old", "new"])
def test_verify_and_revert_invert_either_pad_byte_exactly(request, src, tmp_path, which):
    out = request.getfixturevalue(which)
    r = verify(str(out), source=str(src))
    assert r["scale_pads_checked"] >= 1 and r["source_tensors_compared"] > 0
    revert(str(out), tmp_path / "back")
    same_tensors(src, tmp_path / "back")


def test_a_recorded_layout_without_pad_value_means_0x7f(old, src, tmp_path):
    out = copy_of(old, tmp_path / "nopad")

    def drop(m):
        m["layouts"]["preshuffle"]["scale_transform"].pop("pad_value")

    edit_manifest(out, drop)
    rec = load_manifest(out).layouts["preshuffle"]
    assert "pad_value" not in rec.scale_transform
    assert registry.recorded_layout(rec).scale.pad_value == 0x7F
    verify(str(out), source=str(src))  # its pad bytes are checked against 0x7F
    with pytest.raises(CompatibilityError, match="0x7F"):
        check_compatibility(load_manifest(out), EngineConfig("asm", "ck", profile=ATOM))


def test_verify_refuses_pad_bytes_the_manifest_does_not_record(old, tmp_path):
    out = copy_of(old, tmp_path / "lying")

    def claim_zero(m):
        m["layouts"]["preshuffle"]["version"] = 2
        m["layouts"]["preshuffle"]["scale_transform"]["pad_value"] = 0

    edit_manifest(out, claim_zero)
    with pytest.raises(PrepError, match=r"down_proj\.weight_scale: 1024 pad bytes are not 0x00, the pad its manifest "
                                        r"records \(layout 'preshuffle' version 2\)"):
        verify(str(out))


def test_a_layout_version_newer_than_the_registry_is_refused(old):
    rec = dataclasses.replace(load_manifest(old).layouts["preshuffle"], version=3)
    with pytest.raises(layouts.LayoutsError, match="version 3: this layouts knows versions 1 to 2; upgrade"):
        registry.recorded_layout(rec)


# ------------------------------------------------------------------------------ ATOM's rule
def test_atom_default_gemm_refuses_a_0x7f_k_pad_in_one_line_naming_the_fix(old):
    m = load_manifest(old)
    engine = EngineConfig.reading(m)
    assert engine.gemm_path == "asm"
    with pytest.raises(CompatibilityError) as e:
        check_compatibility(m, engine)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (f"{old}: {DOWN}: K = 1152 pads its S32x8 scale from 36 to 40 columns with 0x7F (layout "
                   "'preshuffle' version 1), and the asm GEMM reads those columns (only 0x00 keeps it right): "
                   "re-convert with this prep version (layout version 2 pads with 0x00)")


def test_atom_triton_preshuffle_gemm_takes_a_0x7f_k_pad(old):
    # aiter's Triton kernels, told the real K (as ATOM calls them), are exact with 0x7F in the pad.
    check_compatibility(load_manifest(old), EngineConfig("triton-preshuffle", "ck", profile=ATOM))


def test_atom_accepts_new_checkpoints_on_every_path_reading_them(new):
    m = load_manifest(new)
    check_compatibility(m, EngineConfig("asm", "ck", profile=ATOM))
    check_compatibility(m, EngineConfig("triton-preshuffle", "ck", profile=ATOM))


def test_an_old_checkpoint_without_a_k_pad_is_accepted(tmp_path):
    # intermediate_size 512: every dense S32x8 scale has K/32 % 8 == 0; only rows may pad.
    src = write_checkpoint(SynthSpec(variant="r1-0528"), tmp_path / "src")
    out = convert_as(src, tmp_path / "old", V1_PRESHUFFLE)
    m = load_manifest(out)
    assert m.layouts["preshuffle"].version == 1
    check_compatibility(m, EngineConfig("asm", "ck", profile=ATOM))


def test_a_nan_pad_byte_is_refused_on_the_triton_preshuffle_gemm(old, tmp_path):
    out = copy_of(old, tmp_path / "nan")
    edit_manifest(out, lambda m: m["layouts"]["preshuffle"]["scale_transform"].update(pad_value=0xFF))
    with pytest.raises(CompatibilityError, match="with 0xFF .* the triton-preshuffle GEMM reads those columns "
                                                 r"\(any byte but 0xFF keeps it right\)"):
        check_compatibility(load_manifest(out), EngineConfig("triton-preshuffle", "ck", profile=ATOM))
