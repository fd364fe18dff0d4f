"""prep convert -> verify -> revert on generated Quark DeepSeek checkpoints: byte-exact round
trips for every layout, TP size and attention variant; per-rank bytes equal to aiter's own
shuffles of the merged tensors; every bad input refused with one line and nothing left behind."""

import errno
import json
import os
import pathlib
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import layouts as L
import prep.file_plan
from layouts.safetensors_file import SafetensorsFile
from layouts.engines import get_engine
from prep.cli import main
from prep.convert import convert
from prep.converted import same_bytes
from prep.deepseek import target_for
from prep.errors import PrepError
from prep.revert import revert
from prep.source import SourceCheckpoint
from prep.testing import SynthSpec
from checkpoints import write_checkpoint
from prep.verify import verify

from conftest import assert_verifies_and_reverts
from hub_cache import fake_hub_cache

ATOM = get_engine("atom")  # the engine whose profile these tests use


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {v: write_checkpoint(SynthSpec(variant=v), root / v) for v in ("r1-0528", "v2")}


def all_tensors(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def xor_byte(path: pathlib.Path, offset: int, mask: int) -> None:
    """Damage one byte of ``path`` in place: the byte at ``offset`` XOR ``mask``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def nothing_left(out: pathlib.Path) -> bool:
    return not out.exists() and not (out.parent / f".{out.name}.prep").exists()


@pytest.mark.parametrize("variant", ["r1-0528", "v2"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("layout, moe_layout", [("preshuffle", "ck"), ("preshuffle", "triton"),
                                                ("non-shuffle", "triton"), ("non-shuffle", "ck")])
def test_convert_verify_revert_is_byte_identical(sources, tmp_path, variant, tp, layout, moe_layout):
    src = sources[variant]
    out, back = tmp_path / "out", tmp_path / "back"
    summary = convert(str(src), out, target_for(ATOM, layout=layout, moe_layout=moe_layout, tp=tp))
    assert summary["files"] == len(list(out.glob("*.safetensors")))
    assert (out / "prep-complete.json").is_file() and (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    verify(str(out), source=str(src))
    revert(str(out), back)
    original, rebuilt = all_tensors(src), all_tensors(back)
    assert original.keys() == rebuilt.keys()
    for name, t in original.items():
        assert rebuilt[name].dtype == t.dtype and same_bytes(rebuilt[name], t), name


@pytest.mark.parametrize("n_routed, tp", [(8, 2), (8, 4), (10, 4)], ids=["8-experts-ep2", "8-experts-ep4", "10-experts-ep4"])
def test_expert_parallel_gives_each_rank_whole_experts_and_round_trips(tmp_path, n_routed, tp):
    src, out, back = tmp_path / "src", tmp_path / "out", tmp_path / "back"
    write_checkpoint(SynthSpec(variant="v2", n_routed_experts=n_routed, num_hidden_layers=2), src)
    convert(str(src), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=tp, ep=tp))
    m = json.loads((out / "prep-manifest.json").read_text())
    w13 = sorted((t for t in m["tensors"] if t["name"] == "model.layers.1.mlp.experts.w13_weight"), key=lambda t: t["rank"])
    per = n_routed // tp
    for t in w13:  # ATOM's expert map: blocks of n_routed // ep, the remainder to the last rank, + the shared one
        r, a = t["rank"], t["runtime_attrs"]
        start, stop = r * per, (n_routed if r == tp - 1 else (r + 1) * per)
        assert a["global_routed_experts"] == [start, stop] and a["shared_expert_slot"] == stop - start
        assert a["num_local_experts"] == stop - start + 1 and t["shape"][0] == stop - start + 1
        assert a["intermediate_pad"] == 0 and t["shape"][1] == 2 * 256  # the intermediate is not split
    verify(str(out), source=str(src))
    revert(str(out), back)
    original, rebuilt = all_tensors(src), all_tensors(back)
    assert original.keys() == rebuilt.keys() and all(torch.equal(rebuilt[n], t) for n, t in original.items())


def test_expert_parallel_rank_holds_aiter_shuffle_of_its_expert_block(sources, tmp_path, aiter_shuffle):
    src, out, rank = sources["v2"], tmp_path / "out", 1
    convert(str(src), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2, ep=2))
    s = all_tensors(src)
    moe = "model.layers.1.mlp"
    experts = [f"{moe}.experts.{e}" for e in range(4, 8)] + [f"{moe}.shared_experts"]
    w13 = torch.stack([torch.cat([s[f"{p}.gate_proj.weight"], s[f"{p}.up_proj.weight"]]) for p in experts])
    assert torch.equal(_rank_tensor(out, f"{moe}.experts.w13_weight", rank), aiter_shuffle.shuffle_weight(w13, layout=(16, 16)))


@pytest.mark.parametrize("moe_layout", ["ck", "triton"])
def test_padding_is_zero_whatever_memory_the_blocks_get(sources, tmp_path, monkeypatch, moe_layout):
    import prep.directio as dio
    import prep.groups as pg

    # Stacked blocks are allocated uninitialised and only the pads are zeroed: give them garbage,
    # both the blocks experts are read into and the writer's staging memory (where an identity
    # weight transform reads experts straight in).
    monkeypatch.setattr(pg, "_alloc", lambda shape: torch.full(shape, 0xAB, dtype=torch.uint8))
    reserve = dio.AlignedFileWriter.reserve

    def dirty_reserve(self, nbytes):
        room = reserve(self, nbytes)
        return room.fill_(0xAB) if room is not None else None

    monkeypatch.setattr(dio.AlignedFileWriter, "reserve", dirty_reserve)
    out = tmp_path / "out"
    convert(str(sources["v2"]), out, target_for(ATOM, layout="non-shuffle", moe_layout=moe_layout, tp=4))  # intermediate 64 per rank, padded to 256
    verify(str(out), source=str(sources["v2"]))  # inverting checks every pad byte is zero
    w13 = _rank_tensor(out, "model.layers.1.mlp.experts.w13_weight", 0)
    raw = L.shuffle.unshuffle_weight(w13) if moe_layout == "ck" else w13
    assert w13.shape == (9, 512, 128) and not raw[:, 64:256].any()


def test_manifest_describes_every_tensor(sources, tmp_path):
    out = tmp_path / "out"
    convert(str(sources["v2"]), out, target_for(ATOM, layout="preshuffle", moe_layout="triton", tp=2))
    m = json.loads((out / "prep-manifest.json").read_text())
    assert m["target"]["tp"] == 2 and m["target"]["arch"] == "deepseek_v3"
    on_disk = {}
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            on_disk.update({(k, f.name): list(h.get_slice(k).get_shape()) for k in h.keys()})
    assert len(on_disk) == len(m["tensors"])
    for t in m["tensors"]:
        assert on_disk[(t["name"], t["file"])] == t["shape"]
    w13 = [t for t in m["tensors"] if t["name"].endswith("experts.w13_weight_scale") and t["rank"] == 1][0]
    assert w13["runtime_attrs"]["scale_swizzle"] == "CDNA4_SCALE"
    assert w13["runtime_attrs"]["intermediate_pad"] == 256 - 128 and w13["runtime_attrs"]["num_local_experts"] == 9
    moe = "model.layers.1.mlp"
    assert w13["sources"] == [f"{moe}.experts.{{0..7}}.gate_proj.weight_scale", f"{moe}.shared_experts.gate_proj.weight_scale",
                              f"{moe}.experts.{{0..7}}.up_proj.weight_scale", f"{moe}.shared_experts.up_proj.weight_scale"]
    assert len(L.manifest.expand_names(w13["sources"])) == 18
    qkv = [t for t in m["tensors"] if t["name"].endswith("fused_qkv_a_proj.weight")][0]
    assert qkv["runtime_attrs"] == {"is_shuffled": True}
    assert qkv["sources"][0].endswith("q_a_proj.weight") and qkv["transforms"][-1]["name"] == "preshuffle"


def test_every_written_tensor_starts_16_byte_aligned_in_a_valid_safetensors_file(sources, tmp_path, monkeypatch):
    # The data section starts on a 4 KiB boundary (the header padded with spaces), so every tensor
    # sits 16-aligned in the file and in the writer's staging memory, where the W16 shuffle moves
    # 16-byte runs: with the 8-byte pad of before, its views were 8-aligned and it ran at 1/4 speed.
    import layouts.shuffle as sh

    runs = []
    run_type = sh._run_type
    monkeypatch.setattr(sh, "_run_type", lambda *ts: runs.append(run_type(*ts)) or runs[-1])
    out = tmp_path / "out"
    convert(str(sources["r1-0528"]), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2))
    assert runs and set(runs) == {torch.complex128}  # every shuffle into staging: 16-byte runs
    files = sorted(out.glob("*.safetensors"))
    for f in files:
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        assert (8 + n) % 4096 == 0 and raw[8 + n - 1:8 + n] in (b" ", b"}"), f.name
        header = json.loads(raw[8:8 + n])
        header.pop("__metadata__")
        assert all((8 + n + t["data_offsets"][0]) % 16 == 0 for t in header.values()), f.name
        with safe_open(str(f), "pt") as h:  # the safetensors library reads it as it is
            assert sorted(h.keys()) == sorted(header)
    assert_verifies_and_reverts(out, sources["r1-0528"], tmp_path / "back")


def _rank_tensor(out, name, rank):
    m = json.loads((out / "prep-manifest.json").read_text())
    t = [t for t in m["tensors"] if t["name"] == name and t["rank"] == rank][0]
    with safe_open(str(out / t["file"]), "pt") as h:
        return h.get_tensor(name)


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 150 << 10], ids=["whole", "blocks-of-2-experts"])
def test_rank_bytes_equal_aiter_shuffles_of_the_merged_rank_tensors(sources, tmp_path, aiter_shuffle, aiter_fp4_utils,
                                                                     monkeypatch, chunk_bytes):
    import prep.convert as pc

    # The stacked experts are built and shuffled in blocks; laid end to end they must be aiter's
    # shuffle of the whole stacked tensor (9 experts of 64 KiB of w13: blocks 2,2,2,2,1).
    monkeypatch.setattr(pc, "CHUNK_BYTES", chunk_bytes)
    src, out, tp, rank = sources["v2"], tmp_path / "out", 2, 1
    convert(str(src), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=tp))
    s = all_tensors(src)
    shuffle, e8m0 = aiter_shuffle.shuffle_weight, aiter_fp4_utils.e8m0_shuffle

    def check_dense(name, w, sc):
        got_w, got_s = _rank_tensor(out, f"{name}.weight", rank), _rank_tensor(out, f"{name}.weight_scale", rank)
        assert torch.equal(got_w, shuffle(w, layout=(16, 16)))
        want_s = e8m0(sc)
        mask = L.shuffle.preshuffle_scale(torch.ones_like(sc), pad_value=0) == 1
        assert torch.equal(got_s[mask], want_s[mask])

    attn = "model.layers.1.self_attn"
    check_dense(f"{attn}.fused_qkv_a_proj",
                torch.cat([s[f"{attn}.q_a_proj.weight"], s[f"{attn}.kv_a_proj_with_mqa.weight"]]),
                torch.cat([s[f"{attn}.q_a_proj.weight_scale"], s[f"{attn}.kv_a_proj_with_mqa.weight_scale"]]))
    ob, osc = s[f"{attn}.o_proj.weight"], s[f"{attn}.o_proj.weight_scale"]  # row parallel: K split
    check_dense(f"{attn}.o_proj", ob[:, rank * ob.shape[1] // tp:(rank + 1) * ob.shape[1] // tp].contiguous(),
                osc[:, rank * osc.shape[1] // tp:(rank + 1) * osc.shape[1] // tp].contiguous())
    mlp = "model.layers.0.mlp"  # dense layer: [gate_rank ; up_rank]
    n = s[f"{mlp}.gate_proj.weight"].shape[0] // tp
    rows = slice(rank * n, (rank + 1) * n)
    check_dense(f"{mlp}.gate_up_proj",
                torch.cat([s[f"{mlp}.gate_proj.weight"][rows], s[f"{mlp}.up_proj.weight"][rows]]),
                torch.cat([s[f"{mlp}.gate_proj.weight_scale"][rows], s[f"{mlp}.up_proj.weight_scale"][rows]]))

    # MoE layer 1: 8 routed experts + the shared one in slot 8, intermediate 256/tp=128 padded to 256.
    moe = "model.layers.1.mlp"
    experts = [f"{moe}.experts.{e}" for e in range(8)] + [f"{moe}.shared_experts"]
    il, ip = 128, 256
    w13 = torch.zeros(9, 2 * ip, 128, dtype=torch.uint8)
    s13 = torch.zeros(9, 2 * ip, 8, dtype=torch.uint8)
    for e, p in enumerate(experts):
        for half, proj in enumerate(("gate_proj", "up_proj")):
            w13[e, half * ip:half * ip + il] = s[f"{p}.{proj}.weight"][rank * il:(rank + 1) * il]
            s13[e, half * ip:half * ip + il] = s[f"{p}.{proj}.weight_scale"][rank * il:(rank + 1) * il]
    assert torch.equal(_rank_tensor(out, f"{moe}.experts.w13_weight", rank), shuffle(w13, layout=(16, 16)))
    got = _rank_tensor(out, f"{moe}.experts.w13_weight_scale", rank)
    flat = s13.reshape(-1, 8)
    mask = L.shuffle.preshuffle_scale(torch.ones_like(flat), pad_value=0) == 1
    assert got.dim() == 2 and torch.equal(got[mask], e8m0(flat)[mask])


def test_cli_convert_json_and_verify(sources, tmp_path):
    out = tmp_path / "out"
    runner = CliRunner()
    r = runner.invoke(main, ["convert", str(sources["v2"]), "-o", str(out), "--tp", "2", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["tensors"] > 0
    r = runner.invoke(main, ["verify", str(out), "--source", str(sources["v2"]), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["ok"] is True
    r = runner.invoke(main, ["inspect", str(sources["v2"]), "--json"])
    info = json.loads(r.output)
    atom = info["layouts_by_tp"]["atom"]
    assert info["mxfp4_modules_by_kind"]["q_b_proj"] == 4 and atom["preshuffle+ck"]["4"] == "ok"
    assert "K % 64" in atom["preshuffle+ck"]["8"]


def test_resume_reuses_verified_files_and_redoes_damaged_ones(sources, tmp_path, monkeypatch):
    import prep.convert as pc

    out = tmp_path / "out"
    monkeypatch.setattr(prep.file_plan, "SHARD_BYTES", 1 << 20)  # several files per rank
    calls = []
    real = pc._write_files

    def flaky(*a, **k):
        calls.append([j.name for j in a[1]])  # a set: the TP ranks' files written together
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(pc, "_write_files", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert(str(sources["v2"]), out, target_for(ATOM, tp=2))
    assert len(calls[0]) == 2
    staging = tmp_path / ".out.prep" / "staging"
    done = sorted(p.name for p in staging.glob("*.safetensors"))
    assert len(done) == 2 and not out.exists()
    # Damage one finished file: resume must redo it, reuse the other.
    damaged = staging / done[0]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    monkeypatch.setattr(pc, "_write_files", real)
    s = convert(str(sources["v2"]), out, target_for(ATOM, tp=2), resume=True)
    assert s["reused_files"] == 1
    verify(str(out), source=str(sources["v2"]))


# ------------------------------------------------------------------------------ bad input
def run_cli(*args):
    return CliRunner().invoke(main, list(args))


def assert_one_line_error(r, *needles):
    assert r.exit_code == 1, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for n in needles:
        assert n in lines[0], lines[0]


def copy_src(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_not_a_quark_checkpoint_is_refused(sources, tmp_path):
    bad = copy_src(sources["v2"], tmp_path / "bf16")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "fp8"
    (bad / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    assert_one_line_error(run_cli("convert", str(bad), "-o", str(out)), "not a Quark checkpoint")
    assert nothing_left(out)
    assert_one_line_error(run_cli("convert", str(tmp_path / "nope"), "-o", str(out)), "no such directory")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run_cli("convert", str(tmp_path / "empty"), "-o", str(out)), "no config.json")


def test_missing_and_truncated_shards_are_named(sources, tmp_path):
    bad = copy_src(sources["v2"], tmp_path / "missing")
    victim = sorted(bad.glob("model-*.safetensors"))[1]
    victim.unlink()
    out = tmp_path / "out"
    assert_one_line_error(run_cli("convert", str(bad), "-o", str(out)), victim.name, "missing")
    bad2 = copy_src(sources["v2"], tmp_path / "trunc")
    victim = sorted(bad2.glob("model-*.safetensors"))[2]
    victim.write_bytes(victim.read_bytes()[:-100])
    assert_one_line_error(run_cli("convert", str(bad2), "-o", str(out)), victim.name, "truncated")
    assert nothing_left(out)


def test_inconsistent_scale_shape_is_named(sources, tmp_path):
    bad = copy_src(sources["v2"], tmp_path / "scale")
    index = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.q_b_proj.weight_scale"
    f = bad / index[name]
    tensors = load_file(f)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, f, metadata={"format": "pt"})
    out = tmp_path / "out"
    assert_one_line_error(run_cli("convert", str(bad), "-o", str(out)), name, "does not match weight")
    assert nothing_left(out)


def test_layout_and_tp_constraints_are_named(sources, tmp_path):
    out = tmp_path / "out"
    r = run_cli("convert", str(sources["v2"]), "-o", str(out), "--tp", "8")
    assert_one_line_error(r, "o_proj.weight", "K % 64 == 0")
    assert_one_line_error(run_cli("convert", str(sources["v2"]), "-o", str(out), "--tp", "3"),
                          "num_attention_heads=8", "tp=3")
    assert_one_line_error(run_cli("convert", str(sources["v2"]), "-o", str(out), "--ep", "2"), "--ep")
    assert_one_line_error(run_cli("convert", str(sources["v2"]), "-o", str(out), "--tp", "2", "--ep", "2",
                                  "--moe-layout", "triton"), "ignores the expert map")
    assert nothing_left(out)


def test_existing_output_needs_force_and_force_never_deletes_a_file_prep_did_not_write(sources, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_line_error(run_cli("convert", str(sources["v2"]), "-o", str(out)), "not empty")
    assert_one_line_error(run_cli("convert", str(sources["v2"]), "-o", str(out), "--force"), "'keep.txt'",
                          "not an output of prep")
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    assert run_cli("convert", str(sources["v2"]), "-o", str(out)).exit_code == 0  # an empty folder is fine
    assert_one_line_error(run_cli("convert", str(sources["v2"]), "-o", str(out)), "previous output of prep", "--force")
    assert run_cli("convert", str(sources["v2"]), "-o", str(out), "--force").exit_code == 0


def test_disk_full_keeps_the_finished_files_for_resume(sources, tmp_path, monkeypatch):
    # A full disk an hour into a conversion (or during a --resume of one) threw the finished files
    # away. They are kept in the work folder, named, and a --resume once space is freed reuses them.
    import prep.directio as dio

    real, calls, limit = os.pwrite, [], [None]

    def full(fd, buf, offset):  # the disk fills up part-way through the conversion
        calls.append(1)
        if limit[0] is not None and len(calls) > limit[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buf, offset)

    monkeypatch.setattr(dio, "STAGING_BYTES", 64 << 10)  # blocks small enough that the tiny model needs many
    monkeypatch.setattr(dio.os, "pwrite", full)
    assert run_cli("convert", str(sources["v2"]), "-o", str(tmp_path / "probe"), "--tp", "2").exit_code == 0
    limit[0], calls[:] = len(calls) * 2 // 3, []  # two thirds of what the whole conversion writes
    out = tmp_path / "out"
    assert_one_line_error(run_cli("convert", str(sources["v2"]), "-o", str(out), "--tp", "2"), "disk full",
                          "the finished files are kept in", "--resume")
    assert not out.exists()
    limit[0] = None  # space freed: --resume reuses what was finished and completes
    r = run_cli("convert", str(sources["v2"]), "-o", str(out), "--tp", "2", "--resume", "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output[r.output.index("{"):])
    assert 1 <= summary["reused_files"] < summary["files"] and not (tmp_path / ".out.prep").exists()
    L.load_manifest(out).verify_hashes()


def test_verify_names_a_tampered_tensor(sources, tmp_path):
    out = tmp_path / "out"
    convert(str(sources["v2"]), out, target_for(ATOM, tp=1))
    m = json.loads((out / "prep-manifest.json").read_text())
    t = [t for t in m["tensors"] if t["name"].endswith("q_b_proj.weight")][0]
    path = out / t["file"]
    with safe_open(str(path), "pt") as h:
        header_len = int.from_bytes(path.read_bytes()[:8], "little")
    data = bytearray(path.read_bytes())
    meta = json.loads(data[8:8 + header_len])[t["name"]]
    data[8 + header_len + meta["data_offsets"][0]] ^= 0x01
    path.write_bytes(bytes(data))
    assert_one_line_error(run_cli("verify", str(out)), t["name"], "hash differs")
    (out / "prep-complete.json").unlink()
    assert_one_line_error(run_cli("verify", str(out)), "did not finish")


def test_hashes_checked_files_at_once_name_the_first_damaged_file_in_file_order(sources, tmp_path):
    """``verify_hashes(workers=N)`` hashes N files at once: the same count and progress as one at
    a time, and with a tensor damaged in the first and the last file, the first file's is named
    (whichever thread found its damage first)."""
    out = tmp_path / "out"
    convert(str(sources["r1-0528"]), out, target_for(ATOM, tp=4))
    m = L.load_manifest(out)
    files = list(dict.fromkeys(t.file for t in m.tensors))
    assert len(files) >= 5
    runs = {}
    for workers in (1, 3):
        seen = []
        runs[workers] = m.verify_hashes(progress=seen.append, workers=workers), seen
    assert runs[1] == runs[3]
    damaged = []
    for fname in (files[0], files[-1]):  # the last tensor of the first file, the first of the last
        f = SafetensorsFile(out / fname)
        info = max(f.tensors.values(), key=lambda i: i.offset) if fname == files[0] else \
            min(f.tensors.values(), key=lambda i: i.offset)
        del f
        xor_byte(out / fname, info.offset, 0x01)
        damaged.append(info.name)
    for workers in (1, 3):
        with pytest.raises(L.ManifestError, match=f"{files[0]}: tensor {damaged[0]} does not match its manifest hash"):
            m.verify_hashes(workers=workers)


@pytest.mark.parametrize("variant, name", [
    ("v2", "model.layers.1.input_layernorm.weight"),  # BF16 pass-through: each TP rank's file has a copy
    ("r1-0528", "model.layers.1.self_attn.q_a_proj.weight"),  # BF16 in a replicated merged group
])
def test_verify_and_revert_compare_bytes_not_float_values(sources, tmp_path, variant, name):
    """Inverted bytes are compared with the source's, and a replicated tensor's copies with one
    another, as bytes: a BF16 tensor holding NaN (unequal to itself as a float; its copies were
    called different, r1-0528's q_a_proj by revert) converts, verifies against its source and
    reverts byte for byte, and a zero whose sign bit changed in the source (-0.0 equals 0.0 as a
    float) is caught."""
    src = tmp_path / "src"
    shutil.copytree(sources[variant], src)
    info = SourceCheckpoint.open(str(src)).info(name)
    path, at = src / info.file, info.offset
    with open(path, "r+b") as f:  # NaN, +0.0, a NaN with another payload (little-endian BF16)
        f.seek(at)
        f.write(bytes([0xC0, 0x7F, 0x00, 0x00, 0x01, 0x7F]))
    out, back = tmp_path / "out", tmp_path / "back"
    convert(str(src), out, target_for(ATOM, tp=2))
    assert verify(str(out), source=str(src))["source_tensors_compared"] > 0
    revert(str(out), back)
    original, rebuilt = all_tensors(src), all_tensors(back)
    assert torch.isnan(original[name].reshape(-1)[0]) and same_bytes(rebuilt[name], original[name])
    with open(path, "r+b") as f:  # the source's +0.0 becomes -0.0
        f.seek(at + 2)
        f.write(bytes([0x00, 0x80]))
    with pytest.raises(PrepError, match=f"{name}: inverted bytes differ from the source"):
        verify(str(out), source=str(src))


def test_verify_source_inverts_units_at_once_and_names_the_first_difference_in_unit_order(sources, tmp_path,
                                                                                        monkeypatch):
    """``verify --source`` inverts several units at once (PREP_VERIFY_WORKERS; each with its share
    of the block budget): the same summary and progress bytes as one at a time, and with the
    source changed in two units in flight together, the error names the earlier unit's tensor."""
    from prep.converted import ConvertedCheckpoint

    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(sources["r1-0528"], src)
    convert(str(src), out, target_for(ATOM, tp=2))
    runs = {}
    for workers in (1, 3):
        monkeypatch.setenv("PREP_VERIFY_WORKERS", str(workers))
        seen = []
        runs[workers] = verify(str(out), source=str(src), progress=seen.append), sum(seen)
    assert runs[1] == runs[3] and runs[1][0]["source_tensors_compared"] == len(SourceCheckpoint.open(str(src)).tensors)
    units = [names for _, names in ConvertedCheckpoint(out).units()]
    first, second = units[0][0], units[1][-1]
    checkpoint = SourceCheckpoint.open(str(src))
    for name in (first, second):
        info = checkpoint.info(name)
        xor_byte(src / info.file, info.offset + info.nbytes // 2, 0x10)  # one byte in the middle of each
    for workers in (1, 3):
        monkeypatch.setenv("PREP_VERIFY_WORKERS", str(workers))
        with pytest.raises(PrepError, match=f"^{first}: inverted bytes differ from the source$"):
            verify(str(out), source=str(src))


def test_same_bytes_compares_bits_at_any_alignment():
    a = torch.tensor([0.0, float("nan"), 1.5, -2.0], dtype=torch.bfloat16)
    assert same_bytes(a, a.clone()) and not torch.equal(a, a.clone())  # NaN: equal bytes, unequal floats
    b = a.clone()
    b[0] = -0.0
    assert not same_bytes(a, b) and torch.equal(a[:1], b[:1])  # -0.0: other bytes, equal floats
    raw = torch.arange(203, dtype=torch.uint8)
    for off in (0, 1, 3, 8):  # 8-byte words where aligned, bytes otherwise and for the tail
        x, y = raw[off:off + 150], raw.clone()[off:off + 150]
        assert same_bytes(x, y)
        y[149] ^= 1
        assert not same_bytes(x, y)
        y[149] ^= 1
        y[0] ^= 0x80
        assert not same_bytes(x, y)
    assert not same_bytes(raw[:8], raw[:9])  # other sizes
    assert same_bytes(raw[:12].view(2, 6).t(), raw[:12].view(2, 6).t().contiguous())  # strided


def test_convert_resolves_a_repo_id_through_the_hub_cache_offline(sources, tmp_path, monkeypatch):
    cache, repo, commit = fake_hub_cache(tmp_path, sources["v2"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", repo, "-o", str(out), "--tp", "2", "--json"])
    assert r.exit_code == 0, r.output
    src = json.loads((out / "prep-manifest.json").read_text())["source"]
    assert (src["kind"], src["repo_id"], src["snapshot"]) == ("hf", repo, commit)
    verify(str(out), source=str(sources["v2"]))
    # A repo id the cache does not hold fails in one line, offline, with nothing written.
    missing = tmp_path / "missing"
    assert_one_line_error(run_cli("convert", "amd/Not-Cached", "-o", str(missing)), "amd/Not-Cached")
    assert nothing_left(missing)


def test_inspect_of_a_converted_checkpoint_says_what_each_rank_reads_and_keeps(sources, tmp_path):
    for exact in (True, False):
        out = tmp_path / f"out-{exact}"
        convert(str(sources["v2"]), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2, ep=2, rank_exact=exact))
        r = CliRunner().invoke(main, ["inspect", str(out), "--json"])
        ranks = json.loads(r.output)["ranks"]
        m = json.loads((out / "prep-manifest.json").read_text())
        common = sum(f["size"] for f in m["files"].values() if f["rank"] is None)
        for x in ranks:
            own = sum(f["size"] for f in m["files"].values() if f["rank"] == x["rank"])
            # Rank-exact: a rank reads its own files, which are what it keeps (plus headers).
            # Format 1: it reads every common file too and keeps a slice of the BF16 in them.
            assert x["bytes"] == (own if exact else own + common) and x["local_experts"] == 5
            assert x["bytes_kept"] <= x["bytes"] and (x["bytes"] - x["bytes_kept"] < 64 << 10) == exact
        assert [x["global_routed_experts"] for x in ranks] == [[0, 4], [4, 8]]
        text = CliRunner().invoke(main, ["inspect", str(out)]).output
        assert "rank 1: reads" in text and "keeps" in text and "routed 4..7 + shared" in text
        kept = [x["bytes_kept"] for x in ranks]
        if exact:
            exact_kept = kept
    assert kept == exact_kept  # format 1's "kept", computed from the rules, is what rank-exact stores


def test_parallel_workers_write_the_same_checkpoint(sources, tmp_path, monkeypatch):
    import prep.convert as pc

    monkeypatch.setattr(prep.file_plan, "SHARD_BYTES", 1 << 20)  # several files per rank, so the pool has work to share
    one, two = tmp_path / "one", tmp_path / "two"
    convert(str(sources["v2"]), one, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2), workers=1)
    convert(str(sources["v2"]), two, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2), workers=2)
    m1, m2 = (json.loads((d / "prep-manifest.json").read_text()) for d in (one, two))
    assert len(m1["files"]) > 3 and m1["tensors"] == m2["tensors"] and m1["files"] == m2["files"]
    for f in m1["files"]:
        assert (one / f).read_bytes() == (two / f).read_bytes(), f
    verify(str(two), source=str(sources["v2"]))


def test_default_workers_follow_the_cores_and_stay_within_the_memory_budget():
    import prep.convert as pc

    sets = [[object()] * 9 for _ in range(20)]  # TP 8: each set is nine files (eight ranks and the common one)
    assert pc.auto_workers(sets, cores=2) == 1  # the CI box and the 2-core VM keep one
    assert pc.auto_workers(sets, cores=8) == 2
    many = pc.auto_workers(sets, cores=64)
    held = [pc.FIXED_BYTES + w * pc._set_bytes(9, pc._depth(w)) for w in (many, many + 1)]
    assert 1 < many < 16 and held[0] <= pc.MEMORY_BUDGET < held[1]  # as many as the budget holds
    assert pc._depth(many) < pc.WRITE_DEPTH  # the writes in flight are shared, not multiplied
    assert pc.auto_workers(sets[:1], cores=64) == 1  # never more than there are sets


def test_an_error_in_a_worker_reaches_the_caller_and_no_output_appears(sources, tmp_path, monkeypatch):
    import prep.convert as pc

    monkeypatch.setattr(prep.file_plan, "SHARD_BYTES", 1 << 20)
    real, calls = pc._write_files, []

    def failing(src, jobs, folder, idents, progress=None, cancel=None, depth=pc.WRITE_DEPTH):
        calls.append(jobs[0].name)
        if len(calls) == 2:
            raise PrepError(f"{jobs[0].name}: injected failure")
        return real(src, jobs, folder, idents, progress, cancel, depth)

    monkeypatch.setattr(pc, "_write_files", failing)
    out = tmp_path / "out"
    with pytest.raises(PrepError, match="injected failure"):
        convert(str(sources["v2"]), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2), workers=2)
    assert nothing_left(out)  # no half-written file stays behind
    r = run_cli("convert", str(sources["v2"]), "-o", str(tmp_path / "o2"), "--workers", "0")
    assert r.exit_code == 2 and "Invalid value for '--workers'" in r.output  # click's usage error


def test_deep_verify_inverts_every_group_without_a_source(sources, tmp_path):
    out = tmp_path / "out"
    convert(str(sources["v2"]), out, target_for(ATOM, layout="preshuffle", moe_layout="triton", tp=4))  # padded experts: pads checked
    r = CliRunner().invoke(main, ["verify", str(out), "--deep", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["ok"] is True, r.output


@pytest.mark.parametrize("windows, message", [
    ([(slice(0, 4), slice(0, 8)), (slice(4, 8), slice(0, 8))], None),  # two halves: whole
    ([(slice(0, 4), slice(0, 8)), (slice(0, 4), slice(0, 8))], "replicated copies differ"),  # same window, other bytes
    ([(slice(0, 4), slice(0, 8)), (slice(2, 6), slice(0, 8))], "overlaps another rank's piece"),
    ([(slice(0, 4), slice(0, 8))], "ranks cover 32 of 64 bytes"),
])
def test_inverting_checks_that_rank_pieces_tile_each_source_tensor(sources, tmp_path, monkeypatch, windows, message):
    import prep.converted as pcv

    out = tmp_path / "out"
    convert(str(sources["v2"]), out, target_for(ATOM, tp=1))
    ck = pcv.ConvertedCheckpoint(out)
    table = {**ck.source_tensors, "fake.weight": L.manifest.SourceTensor("U8", (8, 8), "fake.safetensors")}
    monkeypatch.setattr(pcv.ConvertedCheckpoint, "source_tensors", property(lambda self: table))

    class Piece:  # one rank's piece of "fake.weight", bytes = 10 * rank + 1
        def __init__(self, rec, layout_of):
            self.rec = rec

        def outputs(self):
            return []

        def invert(self, tensors):
            rows, cols = windows[self.rec.rank]
            yield "fake.weight", (rows, cols), torch.full((rows.stop - rows.start, cols.stop - cols.start),
                                                          10 * self.rec.rank + 1, dtype=torch.uint8)

    monkeypatch.setattr(pcv, "group_from_record", Piece)
    ck._groups["fake"] = [L.manifest.GroupRecord("linear", "fake", r, len(windows), "preshuffle", "none")
                          for r in range(len(windows))]
    if message is None:
        got = ck.invert_group("fake")["fake.weight"]
        assert (got[:4] == 1).all() and (got[4:] == 11).all()
    else:
        with pytest.raises(PrepError, match=message):
            ck.invert_group("fake")


@pytest.mark.parametrize("block_experts", [1, 3])
@pytest.mark.parametrize("layout, moe_layout, tp, ep, n_routed", [
    ("preshuffle", "ck", 2, 1, 8), ("non-shuffle", "triton", 4, 1, 8), ("preshuffle", "triton-gfx942", 1, 1, 8),
    ("preshuffle", "ck", 4, 4, 10),  # EP with a remainder: the shared expert's replicated copies are compared
], ids=["ck-tp2", "triton-tp4", "gfx942-tp1", "ck-ep4"])
def test_inverting_experts_a_block_at_a_time_equals_inverting_whole_layers(tmp_path, monkeypatch, block_experts,
                                                                           layout, moe_layout, tp, ep, n_routed):
    import prep.converted as pcv

    src, out, back = tmp_path / "src", tmp_path / "out", tmp_path / "back"
    write_checkpoint(SynthSpec(variant="v2", n_routed_experts=n_routed, num_hidden_layers=2), src)
    convert(str(src), out, target_for(ATOM, layout=layout, moe_layout=moe_layout, tp=tp, ep=ep))
    ck = pcv.ConvertedCheckpoint(out)
    g = next(pcv.group_from_record(r, ck.manifest.recorded_layout) for r in ck.manifest.groups if r.kind == "moe")
    monkeypatch.setattr(pcv, "STREAM_BYTES", block_experts * 2 * g.i_pad * g.h_pad // 2)  # blocks of N experts
    for unit, names in ck.units():
        streamed = list(ck.iter_source_tensors(unit))
        assert [n for n, _ in streamed] == names
        whole = ck.invert_group(unit) if unit in ck._groups else None
        if whole is not None:
            assert all(torch.equal(t, whole[n]) for n, t in streamed), unit
    verify(str(out), source=str(src))
    revert(str(out), back)
    original, rebuilt = all_tensors(src), all_tensors(back)
    assert original.keys() == rebuilt.keys() and all(torch.equal(rebuilt[n], t) for n, t in original.items())


def test_streamed_inversion_refuses_a_piece_of_a_tensor_already_whole(sources, tmp_path, monkeypatch):
    import prep.converted as pcv

    out = tmp_path / "out"
    convert(str(sources["v2"]), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2))
    ck = pcv.ConvertedCheckpoint(out)
    unit = next(r.name for r in ck.manifest.groups if r.kind == "moe")
    ck._groups[unit] = ck._groups[unit] + [ck._groups[unit][0]]  # rank 0's record twice
    with pytest.raises(PrepError, match="already whole|replicated copies"):
        list(ck.iter_source_tensors(unit))


# ------------------------------------------------------------- FP8 per-channel attention (issue 38)
@pytest.fixture(scope="module")
def fp8_attention(tmp_path_factory):
    """A tiny DeepSeek-R1-0528-MXFP4-MTP-MoEFP4: MXFP4 experts, every *self_attn* linear FP8 per
    channel (the MTP layer's too), as Quark's layer_quant_config override writes it."""
    return write_checkpoint(SynthSpec(variant="mtp-moefp4"), tmp_path_factory.mktemp("fp8") / "src")


@pytest.mark.parametrize("engine, tp, ep", [("atom", 1, 1), ("atom", 2, 1), ("atom", 8, 1), ("atom", 8, 8)])
def test_fp8_attention_is_split_and_merged_with_its_scales_and_round_trips(fp8_attention, tmp_path, engine, tp, ep):
    # Each rank holds what ATOM's per-token FP8 linears hold after loading: fused_qkv_a_proj =
    # [q_a ; kv_a] rows with their scales concatenated, q_b / kv_b rows split with their scales
    # ([N/tp, 1], as ATOM allocates a per-channel scale), o_proj columns split with its scale whole
    # on every rank; then, as ATOM's processing leaves them, rows padded to a multiple of 128 (zero
    # weight rows, scale 1.0) and the weight shuffled (fp8-channel-preshuffle / fp8-channel-scale).
    from prep.deepseek import target_for
    from layouts.shuffle import unshuffle_weight

    def held(t: torch.Tensor, n: int) -> torch.Tensor:
        assert t.shape[0] == -(-n // 128) * 128, (t.shape, n)
        if t.dtype == torch.float8_e4m3fn:
            t = unshuffle_weight(t)
            assert not t[n:].view(torch.uint8).any()
        else:
            assert bool((t[n:] == 1).all())
        return t[:n]

    src, out, back = fp8_attention, tmp_path / "out", tmp_path / "back"
    convert(str(src), out, target_for(get_engine(engine), tp=tp, ep=ep))
    s = all_tensors(src)
    m = json.loads((out / "prep-manifest.json").read_text())
    assert m["target"]["fp8_channel_layouts"] == ["fp8-channel-preshuffle", "fp8-channel-scale"]
    for r in range(tp):
        files = {t["file"] for t in m["tensors"] if t["rank"] == r}
        rank = {k: v for f in files for k, v in load_file(out / f).items()}
        for layer in (1, 3):  # a decoder layer and the MTP layer (ATOM's drafter)
            a = f"model.layers.{layer}.self_attn"
            for proj in ("q_b_proj", "kv_b_proj"):
                n = s[f"{a}.{proj}.weight"].shape[0] // tp
                assert same_bytes(held(rank[f"{a}.{proj}.weight"], n), s[f"{a}.{proj}.weight"][r * n:(r + 1) * n])
                scale = held(rank[f"{a}.{proj}.weight_scale"], n)
                assert scale.shape == (n, 1)
                assert same_bytes(scale.view(-1), s[f"{a}.{proj}.weight_scale"][r * n:(r + 1) * n])
            k = s[f"{a}.o_proj.weight"].shape[1] // tp
            o = s[f"{a}.o_proj.weight"]
            assert same_bytes(held(rank[f"{a}.o_proj.weight"], o.shape[0]), o[:, r * k:(r + 1) * k])
            assert same_bytes(rank[f"{a}.o_proj.weight_scale"].view(-1), s[f"{a}.o_proj.weight_scale"])
            want = torch.cat([s[f"{a}.q_a_proj.weight"], s[f"{a}.kv_a_proj_with_mqa.weight"]])
            fused = held(rank[f"{a}.fused_qkv_a_proj.weight"], want.shape[0])
            assert fused.dtype == torch.float8_e4m3fn and same_bytes(fused, want)
            assert same_bytes(held(rank[f"{a}.fused_qkv_a_proj.weight_scale"], want.shape[0]).view(-1),
                              torch.cat([s[f"{a}.q_a_proj.weight_scale"], s[f"{a}.kv_a_proj_with_mqa.weight_scale"]]))
    assert_verifies_and_reverts(out, src, back)


def test_fp8_attention_is_refused_for_sglang_in_one_line_naming_why_and_the_engines_that_serve_it(fp8_attention,
                                                                                                  tmp_path):
    # SGLang's door (its own sharded_state load) derives w_kc/w_vc from kv_b_proj after processing
    # it, and fails on an FP8 one (docs/engines.md "SGLang"): nothing is written for it. ATOM and
    # vLLM serve FP8 attention (tests/test_atom_serve.py, tests/test_vllm_conversion.py).
    r = CliRunner().invoke(main, ["convert", str(fp8_attention), "-o", str(tmp_path / "out"), "--engine", "sglang",
                                  "--tp", "2"])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and nothing_left(tmp_path / "out"), r.output
    assert r.output.startswith("error: model.layers.0.self_attn.kv_a_proj_with_mqa.weight: FP8 per-channel attention: "
                               "SGLang's sharded_state load"), r.output
    assert r.output.endswith("convert with --engine atom or vllm\n"), r.output
    r = CliRunner().invoke(main, ["inspect", str(fp8_attention), "--engine", "sglang"])
    assert r.exit_code == 0 and "FP8 per-channel linears: 20 " in r.output and \
        "not by SGLang (refused: convert for --engine atom or --engine vllm)" in r.output, r.output


def test_fp8_scales_of_another_shape_are_refused_in_one_line(fp8_attention, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fp8_attention, src)
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    shard = next(f for f in sorted(src.glob("*.safetensors")) if name in load_file(f))
    tensors = load_file(shard)
    tensors[name] = tensors[name][:10]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(PrepError, match=f"{name}: an FP8 weight's scale must be F32 or BF16 \\[N\\] or \\[N, 1\\]"):
        convert(str(src), tmp_path / "out", target_for(ATOM, tp=2))
    tensors[name.replace("_scale", "_scale_inv")] = tensors.pop(name)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][name.replace("_scale", "_scale_inv")] = index["weight_map"].pop(name)
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PrepError, match=r"_scale_inv: block scales must be F32 \[ceil\(N/128\), ceil\(K/128\)\] of an "
                                        r"F8_E4M3 weight \[N, K\] \(got F32 \[10\]"):
        convert(str(src), tmp_path / "out", target_for(ATOM, tp=2))
    assert nothing_left(tmp_path / "out")


@pytest.mark.parametrize("extra", ["model.layers.1.self_attn.indexer.wk.weight", "vision_tower.blocks.0.attn.qkv.weight",
                                   "model.layers.1.self_attn.o_proj.bias"],
                         ids=["v3.2-indexer", "vision-tower", "a-bias-deepseek-has-not"])
def test_a_tensor_of_a_module_deepseek_does_not_build_is_refused_naming_it(sources, tmp_path, extra):
    # A module no DeepSeek-V2/V3 config builds was copied whole to every rank (an "other" tensor):
    # a V3.2 checkpoint converted with its indexer replicated, and `prep run` computed without it.
    # Now refused in one line before anything is written, by convert and by the reference engine.
    from safetensors.torch import save_file

    from prep.reference.run import run

    src = tmp_path / "src"
    shutil.copytree(sources["v2"], src)
    save_file({extra: torch.zeros(16, 256, dtype=torch.bfloat16)}, src / "model-extra.safetensors", metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][extra] = "model-extra.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    module = extra.rpartition(".")[0]
    said = (f"{extra}: a tensor 'bias' of {module} is not one prep knows" if extra.endswith(".bias") else
            f"{extra}: no module of DeepSeek-V2/V3 as config.json builds it .* is named {module}; prep does not know "
            "how an engine holds it")
    with pytest.raises(PrepError, match=said):
        convert(str(src), tmp_path / "out", target_for(ATOM, tp=2))
    assert nothing_left(tmp_path / "out")
    with pytest.raises(PrepError, match=f"{extra}: "):
        run(src, [1, 2, 3], source_engine=ATOM)


def test_kimi_k2s_shape_converts_with_48_experts_a_rank_under_ep8_and_inverts_exactly(tmp_path):
    # Kimi-K2 (the kimi-k2 preset: 384 routed experts, 8 chosen, one group, 64 heads, model_type
    # kimi_k2 on DeepSeek-V3's architecture) converts as DeepSeek-V3 does: at TP 8 each rank holds
    # 8 heads' rows; with --ep 8 each holds 48 whole experts and the shared one after them.
    import dataclasses

    from prep.testing import PRESETS

    src = write_checkpoint(dataclasses.replace(PRESETS["kimi-k2"], variant="v2", num_hidden_layers=2, random_bytes=True),
                           tmp_path / "src")
    assert json.loads((src / "config.json").read_text())["model_type"] == "kimi_k2"
    out = tmp_path / "out"
    convert(str(src), out, target_for(ATOM, tp=8, ep=8))
    m = json.loads((out / "prep-manifest.json").read_text())
    w13 = sorted((t for t in m["tensors"] if t["name"] == "model.layers.1.mlp.experts.w13_weight"), key=lambda t: t["rank"])
    assert [t["runtime_attrs"]["global_routed_experts"] for t in w13] == [[48 * r, 48 * (r + 1)] for r in range(8)]
    assert all(t["shape"][0] == 49 for t in w13)  # 48 routed + the shared expert
    q_b = [t for t in m["tensors"] if t["name"] == "model.layers.1.self_attn.q_b_proj.weight"]
    assert {tuple(t["shape"]) for t in q_b} == {(8 * 48, 64)}  # 8 of 64 heads, (nope 32 + rope 16) rows each
    verify(str(out), source=str(src))
