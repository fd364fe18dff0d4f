"""The runtime module an engine imports: the manifest answers what the checkpoint is, every
engine configuration that would misread it is refused with the fix, and a rank loads exactly
the tensors the manifest states, with their runtime attributes."""

import json
import os
import shutil

import pytest
import torch

import layouts as L
from layouts import CompatibilityError, EngineConfig, check_compatibility
from layouts.manifest import ManifestError, load_manifest
from layouts.engines import get_engine
from prep.convert import convert
from prep.deepseek import target_for
from prep.testing import SynthSpec
from checkpoints import write_checkpoint
from safetensors.torch import load_file

ATOM = get_engine("atom")  # the engine whose profile these tests use


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny v2 checkpoint converted four ways: {preshuffle+ck, non-shuffle+triton} x tp {1, 2}, + ep 2."""
    root = tmp_path_factory.mktemp("rt")
    src = write_checkpoint(SynthSpec(variant="v2"), root / "src")
    out = {"src": src}
    for name, (layout, moe_layout, tp, ep) in {
            "pre-ck-tp2": ("preshuffle", "ck", 2, 1), "raw-triton-tp2": ("non-shuffle", "triton", 2, 1),
            "pre-ck-tp1": ("preshuffle", "ck", 1, 1), "pre-ck-ep2": ("preshuffle", "ck", 2, 2),
            "raw-gfx942-tp2": ("non-shuffle", "triton-gfx942", 2, 1)}.items():
        convert(str(src), root / name, target_for(ATOM, layout=layout, moe_layout=moe_layout, tp=tp, ep=ep))
        out[name] = root / name
    # R1-0528 style (attention BF16): what ATOM_USE_TRITON_GEMM=1 can load (layouts/engines/atom/ docstring).
    r1 = write_checkpoint(SynthSpec(variant="r1-0528"), root / "src-r1")
    convert(str(r1), root / "r1-pre-ck-tp2", target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2))
    out["r1-pre-ck-tp2"] = root / "r1-pre-ck-tp2"
    return out


# ------------------------------------------------------------------------------ manifest
def test_manifest_answers_layout_tp_ep_and_per_tensor_attributes(converted):
    m = load_manifest(converted["pre-ck-ep2"])
    assert (m.layout, m.moe_layout, m.tp, m.ep, m.arch) == ("preshuffle", "ck", 2, 2, "deepseek_v3")
    rec = {(t.name, t.rank): t for t in m.tensors}
    w13 = rec[("model.layers.1.mlp.experts.w13_weight", 1)]
    assert w13.runtime_attrs["is_shuffled"] and w13.runtime_attrs["global_routed_experts"] == [4, 8]
    assert all(t.rank in (1, None) for t in m.rank_tensors(1))
    # Rank-exact: a rank reads its own files only (the common file holds what no rank reads).
    assert m.rank_files(1) == [f for f, rec in m.files.items() if rec.rank == 1]
    with pytest.raises(ManifestError, match="rank 2 is out of range"):
        m.rank_tensors(2)


def test_manifest_hash_check_names_the_damaged_tensor(converted, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(converted["pre-ck-tp2"], out)
    m = load_manifest(out, verify_hashes=True)  # intact: passes
    t = next(t for t in m.tensors if t.name.endswith("q_b_proj.weight") and t.rank == 0)
    f = out / t.file
    raw = bytearray(f.read_bytes())
    hdr = 8 + int.from_bytes(raw[:8], "little")
    start = hdr + json.loads(raw[8:hdr])[t.name]["data_offsets"][0]
    raw[start] ^= 0x01
    f.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match="q_b_proj.weight does not match its manifest hash"):
        load_manifest(out, verify_hashes=True)


def test_unfinished_or_modified_conversions_are_refused(converted, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(converted["pre-ck-tp1"], out)
    (out / "prep-manifest.json").write_text((out / "prep-manifest.json").read_text().replace('"tp":1', '"tp":2'))
    with pytest.raises(ManifestError, match="differs from the completion marker"):
        load_manifest(out)
    (out / "prep-complete.json").unlink()
    with pytest.raises(ManifestError, match="did not finish"):
        load_manifest(out)


# ------------------------------------------------------------------------------ compatibility
@pytest.mark.parametrize("ckpt, engine, message", [
    ("pre-ck-tp2", EngineConfig("triton-non-shuffle", "ck", 2, profile=ATOM),
     "checkpoint is preshuffled; the non-shuffle Triton GEMM would read garbage: unset "
     "ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM or convert with --layout non-shuffle"),
    ("raw-triton-tp2", EngineConfig("asm", "triton", 2, profile=ATOM), "set ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM=1 or convert with --layout preshuffle"),
    ("raw-triton-tp2", EngineConfig("triton-preshuffle", "triton", 2, profile=ATOM), "the Triton preshuffle GEMM reads W16/S32x8"),
    ("pre-ck-tp2", EngineConfig("asm", "ck", 4, profile=ATOM), "converted for tp=2 but the engine runs tp=4"),
    ("pre-ck-tp2", EngineConfig("asm", "ck", 2, rank=2, profile=ATOM), "rank 2 is out of range"),
    ("pre-ck-tp2", EngineConfig("asm", "triton", 2, profile=ATOM), "set ATOM_USE_TRITON_MOE=0 or convert with --moe-layout triton"),
    ("raw-triton-tp2", EngineConfig("triton-non-shuffle", "ck", 2, profile=ATOM), "set ATOM_USE_TRITON_MOE=1 or convert with --moe-layout ck"),
    ("raw-triton-tp2", EngineConfig("triton-non-shuffle", "triton", 2, gpu_arch="gfx942", profile=ATOM), "--moe-layout triton-gfx942"),
    ("raw-gfx942-tp2", EngineConfig("triton-non-shuffle", "triton", 2, gpu_arch="gfx950", profile=ATOM), "--moe-layout triton"),
    ("pre-ck-tp2", EngineConfig("asm", "ck", 2, ep_size=2, profile=ATOM), "converted with ep=1 but the engine runs ep=2"),
    ("pre-ck-ep2", EngineConfig("asm", "ck", 2, profile=ATOM), "converted with ep=2 but the engine runs ep=1"),
    ("pre-ck-tp2", EngineConfig("triton-preshuffle", "ck", 2, profile=ATOM), "unset ATOM_USE_TRITON_GEMM"),
])
def test_every_mismatch_is_refused_with_its_fix(converted, ckpt, engine, message):
    with pytest.raises(CompatibilityError) as e:
        check_compatibility(load_manifest(converted[ckpt]), engine)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_matching_configurations_pass(converted):
    check_compatibility(load_manifest(converted["pre-ck-tp2"]), EngineConfig("asm", "ck", 2, rank=1, profile=ATOM))
    check_compatibility(load_manifest(converted["r1-pre-ck-tp2"]), EngineConfig("triton-preshuffle", "ck", 2, profile=ATOM))
    check_compatibility(load_manifest(converted["raw-triton-tp2"]), EngineConfig("triton-non-shuffle", "triton", 2, profile=ATOM))
    check_compatibility(load_manifest(converted["raw-gfx942-tp2"]),
                        EngineConfig("triton-non-shuffle", "triton", 2, gpu_arch="gfx942", profile=ATOM))
    check_compatibility(load_manifest(converted["pre-ck-ep2"]), EngineConfig("asm", "ck", 2, ep_size=2, profile=ATOM))


def test_expert_parallel_with_the_triton_moe_is_refused():
    from layouts.manifest import Manifest

    m = Manifest.from_json({"target": {"layout": "preshuffle", "moe_layout": "triton", "tp": 2, "ep": 2}, "tensors": []})
    with pytest.raises(CompatibilityError, match="ignores the expert map"):
        check_compatibility(m, EngineConfig("triton-preshuffle", "triton", 2, ep_size=2, profile=ATOM))


@pytest.mark.parametrize("env, arch, want", [
    ({}, "gfx950", ("asm", "ck")),
    ({}, "gfx942", ("asm", "triton")),  # ATOM: Triton MoE on gfx94x when the switch is unset
    ({"ATOM_USE_TRITON_GEMM": "1"}, "gfx950", ("triton-preshuffle", "triton")),
    ({"ATOM_USE_TRITON_GEMM": "1", "ATOM_USE_TRITON_MOE": "0"}, "gfx950", ("triton-preshuffle", "ck")),
    ({"ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM": "1", "ATOM_USE_TRITON_MOE": "1"}, "gfx950", ("triton-non-shuffle", "triton")),
    ({"ATOM_USE_TRITON_GEMM": "true"}, "gfx950", ("asm", "ck")),  # ATOM reads only "1" as on
    ({"ATOM_USE_TRITON_MOE": ""}, "gfx942", ("asm", "triton")),  # empty is unset (ATOM's envs.is_set)
    ({"ATOM_USE_TRITON_MOE": "", "ATOM_USE_TRITON_GEMM": "1"}, "gfx950", ("triton-preshuffle", "triton")),
])
def test_engine_config_reads_atom_switches_as_atom_does(env, arch, want):
    e = EngineConfig.from_env(ATOM, tp_size=8, rank=3, gpu_arch=arch, env=env)
    assert (e.gemm_path, e.moe_backend) == want and (e.tp_size, e.rank) == (8, 3)
    assert e.input_norm_quant_fusion and e.qknorm_quant_fusion


def test_engine_config_reads_the_two_fusion_switches():
    e = EngineConfig.from_env(ATOM, env={"ATOM_ENABLE_DS_INPUT_RMSNORM_QUANT_FUSION": "0",
                                   "ATOM_ENABLE_DS_QKNORM_QUANT_FUSION": "1"}, gpu_arch="gfx950")
    assert (e.input_norm_quant_fusion, e.qknorm_quant_fusion) == (False, True)


@pytest.mark.parametrize("switch, says", [("ATOM_MOE_GU_ITLV", "gate and up rows interleaved"),
                                          ("ATOM_USE_TRITON_MOE_DECODE", "decode MoE's own copies")])
def test_moe_switches_that_change_the_expert_bytes_are_refused(switch, says):
    with pytest.raises(CompatibilityError, match=f"{switch}=1: .*{says}.*unset {switch}"):
        EngineConfig.from_env(ATOM, env={switch: "1"}, gpu_arch="gfx950")
    assert EngineConfig.from_env(ATOM, env={switch: "0"}, gpu_arch="gfx950").moe_backend == "ck"


def test_triton_gemm_with_non_shuffle_gemm_is_refused():
    with pytest.raises(CompatibilityError, match="unset one of the two"):
        EngineConfig.from_env(ATOM, env={"ATOM_USE_TRITON_GEMM": "1", "ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM": "1"})


def test_unknown_paths_and_archs_are_refused():
    with pytest.raises(CompatibilityError, match="unknown GEMM path"):
        EngineConfig("hipblaslt", profile=ATOM)
    with pytest.raises(CompatibilityError, match="gfx1250"):
        EngineConfig(gpu_arch="gfx1250", profile=ATOM)


# ------------------------------------------------------------------------------ rank loader
@pytest.mark.parametrize("mmap, direct", [(True, False), (False, False), (False, True)],
                         ids=["mapped", "pread", "direct"])
@pytest.mark.parametrize("ckpt, rank", [("pre-ck-tp2", 0), ("pre-ck-tp2", 1), ("raw-triton-tp2", 1), ("pre-ck-ep2", 1)])
def test_load_rank_returns_exactly_the_manifest_tensors_with_attributes(converted, ckpt, rank, mmap, direct):
    root = converted[ckpt]
    m = load_manifest(root)
    tensors = L.load_rank(root, rank, verify_hashes=True, mmap=mmap, direct=direct)  # every tensor re-hashed
    want = {t.name: t for t in m.rank_tensors(rank)}
    assert list(tensors) == list(want)
    on_disk = {}
    for f in m.rank_files(rank):
        on_disk.update(load_file(root / f))
    for name, t in tensors.items():
        rec = want[name]
        assert torch.equal(t, on_disk[name]) and tuple(t.shape) == rec.shape
        for k, v in rec.runtime_attrs.items():
            assert getattr(t, k) == v
    w13s = tensors["model.layers.1.mlp.experts.w13_weight_scale"]
    if m.moe_layout == "ck":
        assert w13s.dim() == 2 and w13s.is_shuffled  # CK MoE scales are stored 2-D, flattened over experts
    else:
        assert w13s.dim() == 3 and w13s.scale_swizzle == "CDNA4_SCALE"
    assert tensors["model.layers.1.self_attn.fused_qkv_a_proj.weight"].is_shuffled == (m.layout == "preshuffle")


@pytest.mark.parametrize("direct", [False, True])
def test_load_rank_to_a_gpu_reads_each_file_through_the_staged_reader(converted, monkeypatch, direct):
    # No GPU here: the staged reader's target is a CPU tensor (its own tests run it that way),
    # standing in for the device buffer; what is pinned is the wiring: every file of the rank,
    # once, with ``direct`` passed on, and tensors equal to the plain CPU load.
    import layouts.device_load as dl
    import layouts.loader as loader

    calls = []

    def to_cpu(sf, device, *, direct=True, readers=None, block=None):
        assert device.type == "cuda"
        calls.append((sf.path.name, direct))
        return dl.read_to_device(sf, torch.device("cpu"), direct=direct, block=1 << 16, readers=3)

    monkeypatch.setattr(loader, "read_to_device", to_cpu)
    root = converted["pre-ck-tp2"]
    got = L.load_rank(root, 1, "cuda", direct=direct)
    m = load_manifest(root)
    assert sorted(calls) == sorted((f, direct) for f in m.rank_files(1))
    want = L.load_rank(root, 1)
    assert list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert got["model.layers.1.self_attn.fused_qkv_a_proj.weight"].is_shuffled


def test_load_rank_reads_only_its_own_files(converted, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(converted["pre-ck-tp2"], out)
    for f in out.glob("model-tp2-rank1-*"):
        f.unlink()  # rank 0 must not need rank 1's files
    assert len(L.load_rank(out, 0)) > 0
    with pytest.raises(ManifestError, match="rank1.*missing; convert again"):
        L.load_rank(out, 1)


def test_load_rank_refuses_an_incompatible_engine_before_reading(converted):
    with pytest.raises(CompatibilityError, match="preshuffled"):
        L.load_rank(converted["pre-ck-tp2"], 0, engine=EngineConfig("triton-non-shuffle", "ck", 2, rank=0, profile=ATOM))


def test_load_rank_names_a_tensor_whose_shape_disagrees(converted, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(converted["pre-ck-tp1"], out)
    mpath = out / "prep-manifest.json"
    raw = json.loads(mpath.read_text())
    t = next(t for t in raw["tensors"] if t["name"].endswith("o_proj.weight"))
    t["shape"] = [t["shape"][1], t["shape"][0]]
    data = json.dumps(raw, separators=(",", ":")).encode()
    mpath.write_bytes(data)
    marker = json.loads((out / "prep-complete.json").read_text())
    marker["manifest_sha256"] = L.manifest.manifest_hash(data)
    (out / "prep-complete.json").write_text(json.dumps(marker))
    with pytest.raises(ManifestError, match=f"tensor {t['name']} is torch.uint8 .* but the manifest says U8"):
        L.load_rank(out, 0)


def test_load_rank_rebuilds_the_source_through_the_layouts(converted):
    # What the engine holds, inverted through the registry, is the source's bytes: the loaded
    # tensors are usable, not only present.
    src = load_file(next(converted["src"].glob("*.safetensors")))
    src = {}
    for f in converted["src"].glob("*.safetensors"):
        src.update(load_file(f))
    t = L.load_rank(converted["pre-ck-tp1"], 0)
    name = "model.layers.1.self_attn.q_b_proj"
    w, s = t[f"{name}.weight"], t[f"{name}.weight_scale"]
    want_w, want_s = src[f"{name}.weight"], src[f"{name}.weight_scale"]
    bw, bs = L.get_layout(w.prep_layout).invert(w, s, want_w.shape, want_s.shape)
    assert torch.equal(bw, want_w) and torch.equal(bs, want_s)


# ------------------------------------------------------------------------------ activation plan
@pytest.mark.parametrize("engine, m, want", [
    (EngineConfig("asm", "ck", 2, profile=ATOM), 1, (True, True)),
    (EngineConfig("triton-preshuffle", "ck", 2, profile=ATOM), 31, (False, False)),
    (EngineConfig("triton-preshuffle", "ck", 2, profile=ATOM), 32, (True, True)),
])
def test_activation_plan_picks_flags_per_call_from_the_token_count(converted, engine, m, want):
    ckpt = "r1-pre-ck-tp2" if engine.gemm_path == "triton-preshuffle" else "pre-ck-tp2"  # ATOM: BF16 attention only
    plan = L.ActivationQuantPlan.for_checkpoint(load_manifest(converted[ckpt]), engine)
    assert tuple(plan.flags(m)) == want
    x, w = torch.randn(m, 256, dtype=torch.bfloat16), torch.rand(256, dtype=torch.bfloat16) + 0.5
    res = torch.randn(m, 256, dtype=torch.bfloat16)
    (q, scale), new_res = plan.input_layernorm(x, w, 1e-6, res)
    ref = L.fused_rms_mxfp4_quant(x, w, 1e-6, res1=res, shuffle=want[0], scale_shuffle_padding=want[1], backend="torch")
    assert torch.equal(q, ref[0][0]) and torch.equal(scale, ref[0][1]) and torch.equal(new_res, ref[2])
    assert scale.shape == ((256, 8) if want[1] else (m, 8))


def test_activation_plan_q_a_site_quantizes_q_and_norms_kv(converted):
    plan = L.ActivationQuantPlan.for_checkpoint(load_manifest(converted["raw-triton-tp2"]),
                                                EngineConfig("triton-non-shuffle", "triton", 2, profile=ATOM))
    q_c, kv_c = torch.randn(40, 128, dtype=torch.bfloat16), torch.randn(40, 128, dtype=torch.bfloat16)
    wq, wkv = torch.rand(128, dtype=torch.bfloat16) + 0.5, torch.rand(128, dtype=torch.bfloat16) + 0.5
    (q, scale), kv = plan.q_a_layernorm(q_c, wq, 1e-6, kv_c, wkv, 1e-6)
    assert q.shape == (40, 64) and scale.shape == (40, 4)  # non-shuffle path: raw, unpadded scales
    qf = q_c.float()
    normed = qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + 1e-6) * wq.float()  # float32, not rounded to bf16
    want_q, want_s = L.mxfp4.quantize(normed, L.mxfp4.AITER_TRITON)
    assert torch.equal(q, want_q) and torch.equal(scale, want_s)
    assert torch.allclose(kv.float(), L.activation.rms_norm(kv_c, wkv, 1e-6).float(), atol=1e-2)


def test_activation_plan_without_fusion_returns_bf16_norms(converted):
    engine = EngineConfig("asm", "ck", 2, input_norm_quant_fusion=False, qknorm_quant_fusion=False, profile=ATOM)
    plan = L.ActivationQuantPlan.for_checkpoint(load_manifest(converted["pre-ck-tp2"]), engine)
    x, w = torch.randn(4, 256, dtype=torch.bfloat16), torch.ones(256, dtype=torch.bfloat16)
    (y, scale), res = plan.input_layernorm(x, w, 1e-6)
    assert scale is None and y.dtype == torch.bfloat16 and torch.equal(res, x)


# ------------------------------------------------------------------------------ safetensors reader
def _raw_safetensors(path, header: dict, data: bytes, pad_to: int = 8):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % pad_to) if pad_to else b""
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize("header, message", [
    ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 4]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}},
     "a is U8 [8] but spans bytes [0, 4)"),
    ({"a": {"dtype": "U16", "shape": [4], "data_offsets": [0, 8]}}, "dtype U16, which this reader does not know"),
    ({"a": {"dtype": "U8", "shape": [8]}}, "header entry of a is malformed"),
    ({"a": {"dtype": ["U8"], "shape": [8], "data_offsets": [0, 8]}}, "header entry of a is malformed"),
    ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 4, 8]}}, "header entry of a is malformed"),
    ({"a": {"dtype": "U8", "shape": [-2, -4], "data_offsets": [0, 8]}}, "a is U8 [-2, -4] but spans bytes [0, 8)"),
    ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [8, 0]}}, "a is U8 [8] but spans bytes [8, 0)"),
    ({"a": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}}, "header says"),
])
def test_the_safetensors_reader_refuses_headers_that_disagree_with_themselves(tmp_path, header, message):
    from layouts.safetensors_file import SafetensorsFile, SafetensorsFileError

    f = _raw_safetensors(tmp_path / "x.safetensors", header, bytes(range(8)))
    with pytest.raises(SafetensorsFileError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        SafetensorsFile(f)


@pytest.mark.parametrize("header_pad", [0, 1, 2, 3])
def test_mapped_views_work_whatever_the_alignment_of_the_data_section(tmp_path, header_pad):
    from layouts.safetensors_file import SafetensorsFile, map_all

    header = {"f": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "u": {"dtype": "U8", "shape": [3], "data_offsets": [8, 11]}}
    raw = json.dumps(header).encode() + b" " * header_pad
    data = torch.tensor([1.5, -2.0]).numpy().tobytes() + b"\x01\x02\x03"
    f = tmp_path / "x.safetensors"
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    sf = SafetensorsFile(f)
    _, mapped = map_all(sf)
    _, read = sf.read_all()
    for views in (mapped, read):
        assert torch.equal(views["f"], torch.tensor([1.5, -2.0])) and views["u"].tolist() == [1, 2, 3]


def test_a_transform_that_is_not_a_permutation_gets_no_position_map():
    import dataclasses

    from layouts.dequant import stored_positions
    from layouts.transforms import Transform

    @dataclasses.dataclass(frozen=True)
    class Duplicating(Transform):  # copies element 0 over element 1: loses a byte
        name = "duplicating"

        def forward(self, t):
            t = t.clone().reshape(-1)
            t[1] = t[0]
            return t

    with pytest.raises(ValueError, match="not a permutation"):
        stored_positions(Duplicating(), (2, 2))


def test_triton_moe_checkpoint_on_another_arch_names_the_arch(converted):
    with pytest.raises(CompatibilityError, match="run on the GPU the checkpoint was made for"):
        check_compatibility(load_manifest(converted["raw-gfx942-tp2"]), EngineConfig("triton-non-shuffle", "triton", 2, profile=ATOM))


@pytest.mark.parametrize("block", [7, 64, 1 << 20])
def test_one_pass_hashing_equals_hashing_each_tensor(tmp_path, monkeypatch, block):
    import layouts.safetensors_file as sf
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for i, n in enumerate([0, 1, 100, 5, 300, 0])}
    tensors["bf"] = torch.randn(3, 17, generator=g).to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "x.safetensors"))
    monkeypatch.setattr(sf, "READ_BLOCK", block)  # blocks that cut tensors anywhere
    f = sf.SafetensorsFile(tmp_path / "x.safetensors")
    want = {n: sf.tensor_hash(f.get(n)) for n in f.tensors}
    assert f.hash_tensors() == want
    assert f.hash_tensors(["t4", "bf", "t5"]) == {n: want[n] for n in ("t4", "bf", "t5")}
    with pytest.raises(KeyError):
        f.hash_tensors(["nope"])


def test_a_file_renamed_over_the_checked_one_is_not_what_gets_mapped(tmp_path):
    # load_rank checks a file's header through its descriptor, then maps it: the mapping must be
    # of that descriptor, not of whatever the path names by then (torch.from_file re-opened it).
    from layouts.safetensors_file import SafetensorsFile, map_all

    def write(path, values):
        raw = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + torch.tensor(values).numpy().tobytes())

    checked, other = tmp_path / "x.safetensors", tmp_path / "y.safetensors"
    write(checked, [1.0, 2.0])
    write(other, [7.0, 8.0])
    sf = SafetensorsFile(checked)
    os.replace(other, checked)  # swapped between the header check and the mapping
    _, views = map_all(sf)
    assert views["w"].tolist() == [1.0, 2.0]
    views["w"][0] = 5.0  # copy-on-write: the file is never written through the mapping
    assert SafetensorsFile(checked).read_all()[1]["w"].tolist() == [7.0, 8.0]


def test_open_rank_checks_once_and_carries_the_tensors_and_the_plan(converted, monkeypatch):
    # One call for what the README's sequence did in three (load_manifest, check_compatibility,
    # load_rank with its own check, the plan with a third): the check runs once, before a byte.
    import layouts.loader

    root = converted["pre-ck-tp2"]
    calls = []
    real = layouts.loader.check_compatibility

    def counted(m, e):
        calls.append(e)
        return real(m, e)

    monkeypatch.setattr(layouts.loader, "check_compatibility", counted)
    engine = EngineConfig("asm", "ck", 2, rank=1, profile=ATOM)
    opened = L.open_rank(root, engine)
    assert len(calls) == 1 and opened.rank == 1 and opened.engine is engine
    plain = L.load_rank(root, 1)
    assert list(opened.tensors) == list(plain) and all(torch.equal(opened.tensors[k], plain[k]) for k in plain)
    assert opened.tensors["model.layers.1.mlp.experts.w13_weight"].is_shuffled is True
    assert opened.plan == L.ActivationQuantPlan.for_checkpoint(load_manifest(root), engine)
    assert opened.plan.flags(4) == (True, True)  # asm: shuffled, padded scales
    calls.clear()
    with pytest.raises(L.CompatibilityError, match="set ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM=1|--layout"):
        L.open_rank(root, EngineConfig("triton-non-shuffle", "ck", 2, rank=0, profile=ATOM))
    assert len(calls) == 1
