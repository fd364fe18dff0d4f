"""Hostile or damaged input to the reading layer: safetensors headers, indexes, config.json,
manifests and the files they name. Each is refused before anything is allocated, looped over,
opened outside the folder or waited on, with one line that names the file (or tensor, or key)
and the fix, as the type its API promises: PrepError in prep (one ``error:`` line from the CLI),
SafetensorsFileError / ManifestError in layouts. And nothing is written or left behind.

One checkpoint is generated and converted per module; each case works on its own copy."""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import layouts as L
from layouts.manifest import ManifestError, load_manifest
from layouts.safetensors_file import SafetensorsFile, SafetensorsFileError
from layouts.engines import get_engine
from prep.cli import main
from prep.convert import convert
from prep.deepseek import target_for
from prep.errors import PrepError
from prep.source import SourceCheckpoint
from prep.testing import SynthSpec, drop_tensors
from checkpoints import write_checkpoint

ATOM = get_engine("atom")  # the engine whose profile these tests use

REPO = pathlib.Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny v2 source checkpoint and its tp=2 conversion."""
    root = tmp_path_factory.mktemp("hostile")
    src = write_checkpoint(SynthSpec(variant="v2"), root / "src")
    out = root / "tp2"
    convert(str(src), out, target_for(ATOM, tp=2))
    return {"src": src, "out": out}


# ------------------------------------------------------------------------------ helpers
def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(r, *needles):
    assert r.exit_code == 1, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "internal error" not in lines[0], lines[0]  # a typed error with its own message, not the catch-all
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def assert_manifest_refused(out, message):
    """Both readers of a manifest (``load_manifest``, ``load_rank``) refuse it with one line of
    ManifestError naming the file, ``message`` and the fix."""
    for load in (load_manifest, lambda p: L.load_rank(p, 0)):
        with pytest.raises(ManifestError) as e:
            load(out)
        msg = str(e.value)
        assert type(e.value) is ManifestError and "\n" not in msg, msg
        assert message in msg and "prep-manifest.json" in msg and "convert again" in msg, msg


def nothing_left(out: pathlib.Path) -> bool:
    return not out.exists() and not any(out.parent.glob(f".{out.name}*"))


def copy(folder: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(folder, dst)  # real copies: cases edit files in place
    return dst


def raw_safetensors(path: pathlib.Path, header_text: bytes | str, data: bytes) -> pathlib.Path:
    raw = header_text.encode() if isinstance(header_text, str) else header_text
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def header_file(path, header: dict, data: bytes) -> pathlib.Path:
    return raw_safetensors(path, json.dumps(header), data)


def edit_json(path: pathlib.Path, fn) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def set_manifest(folder: pathlib.Path, data: bytes) -> None:
    """Replace the manifest and keep the completion marker's hash in step with it (what a
    damaged or crafted folder that passes the hash check looks like)."""
    (folder / "prep-manifest.json").write_bytes(data)
    marker = json.loads((folder / "prep-complete.json").read_text())
    marker["manifest_sha256"] = hashlib.sha256(data).hexdigest()
    (folder / "prep-complete.json").write_text(json.dumps(marker))


def edit_manifest(folder: pathlib.Path, fn) -> None:
    m = json.loads((folder / "prep-manifest.json").read_text())
    fn(m)
    set_manifest(folder, json.dumps(m, separators=(",", ":")).encode())


def edit_source_table(folder: pathlib.Path, fn) -> None:
    """Edit ``fn(tensors)`` the source tensor table (prep-source.json), and the manifest's hash
    and count of it and the marker in step (a crafted folder that passes every hash check)."""
    table = json.loads((folder / "prep-source.json").read_text())
    fn(table["tensors"])
    data = json.dumps(table, separators=(",", ":")).encode()
    (folder / "prep-source.json").write_bytes(data)
    edit_manifest(folder, lambda m: m["source"]["tensors_file"].update(
        sha256=hashlib.sha256(data).hexdigest(), count=len(table["tensors"])))


def in_subprocess(code: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, killed after ``timeout``: for cases that hung or
    exhausted memory before they were refused, so a regression fails instead of stalling."""
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def listing(folder: pathlib.Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_size) for p in folder.iterdir() if not p.is_fifo() and not p.is_symlink())


# ------------------------------------------------------------------------------ 5: sizes that exhaust memory or hang
def test_a_zero_byte_tensor_with_a_dimension_beyond_the_file_size_is_refused_at_parse_time(tmp_path):
    f = header_file(tmp_path / "x.safetensors", {"huge": {"dtype": "BF16", "shape": [2**62, 0], "data_offsets": [0, 0]}},
                    b"")
    with pytest.raises(SafetensorsFileError, match=r"huge has shape \[4611686018427387904, 0\], a dimension larger than"):
        SafetensorsFile(f)


def test_convert_of_a_shard_with_a_2_62_row_empty_tensor_stops_at_once(made, tmp_path):
    # Before: convert's row-block loop walked 2**62 rows, growing ~200 MB/s. In a process of its
    # own, so a regression is killed by the timeout rather than taking the test run with it.
    bad = copy(made["src"], tmp_path / "src")
    header_file(bad / "model-extra.safetensors", {"model.extra.weight": {"dtype": "BF16", "shape": [2**62, 0],
                                                                         "data_offsets": [0, 0]}}, b"")
    edit_json(bad / INDEX, lambda ix: ix["weight_map"].__setitem__("model.extra.weight", "model-extra.safetensors"))
    out = tmp_path / "out"
    r = in_subprocess("from prep.cli import main; main()", "convert", bad, "-o", out, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "model-extra.safetensors" in lines[0] \
        and "a dimension larger than the file" in lines[0], r.stderr
    assert nothing_left(out)


@pytest.mark.parametrize("key, value, says", [
    ("num_nextn_predict_layers", 1e9, "num_nextn_predict_layers is 1000000000.0, not an integer"),
    ("num_nextn_predict_layers", 10**9, "num_nextn_predict_layers is 1000000000, not an integer in [0, 239] "
                                        "(the checkpoint holds 239 tensors)"),
    # An integer count is walked lazily: the first layer or expert missing stops it.
    ("n_routed_experts", 10**18, f"model.layers.1.mlp.experts.8.gate_proj.weight is missing (config.json has "
                                 f"n_routed_experts={10**18})"),
    ("num_hidden_layers", -1, "num_hidden_layers is -1, not an integer"),
    ("num_hidden_layers", "3", "num_hidden_layers is '3', not an integer"),
    ("first_k_dense_replace", True, "first_k_dense_replace is True, not an integer"),
    ("num_attention_heads", "8", "num_attention_heads is '8', not an integer"),
    ("hidden_size", 2**40, f"hidden_size is {2**40}, not an integer in [1, 16777216]"),
    ("q_lora_rank", 0.5, "q_lora_rank is 0.5, not an integer"),
], ids=lambda v: str(v)[:24])
def test_config_values_that_are_not_sane_integers_are_refused_naming_the_key(made, tmp_path, key, value, says):
    bad = copy(made["src"], tmp_path / "src")
    edit_json(bad / "config.json", lambda c: c.__setitem__(key, value))
    assert_one_line_error(run_cli("inspect", bad), says)
    if key == "num_nextn_predict_layers":
        out = tmp_path / "out"
        assert_one_line_error(run_cli("convert", bad, "-o", out), key)
        assert nothing_left(out)


@pytest.mark.parametrize("config, says", [
    (b"[1, 2]", "config.json: a JSON list, not an object"),
    (b'{"a": 1, "a": 2}', "config.json: names 'a' twice"),
    ('{"architectures": ["DeepseekV3ForCausalLM"]}'.encode("utf-16"), "config.json: not valid UTF-8 JSON"),
    (b'{"pad":"' + b"x" * 3_200_000 + b'","a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ("ARCH", "architecture [{'x': 1}] (model_type None) is no family prep knows"),
    ("QUANT", "not a Quark checkpoint"),
], ids=["a-list", "duplicate-key", "utf-16", "nested", "architectures-of-objects", "quantization-config-a-string"])
def test_a_config_json_that_is_not_a_plain_object_is_refused_in_one_line(made, tmp_path, config, says):
    bad = copy(made["src"], tmp_path / "src")
    if config == "ARCH":
        edit_json(bad / "config.json", lambda c: (c.__setitem__("architectures", [{"x": 1}]), c.pop("model_type")))
    elif config == "QUANT":
        edit_json(bad / "config.json", lambda c: c.__setitem__("quantization_config", "quark"))
    else:
        (bad / "config.json").write_bytes(config)
    out = tmp_path / "out"
    assert_one_line_error(run_cli("convert", bad, "-o", out), says)
    assert nothing_left(out)


def test_a_config_with_more_layers_than_present_fails_at_the_first_missing_layer(made, tmp_path):
    # Within the bound (no more layers than tensors) yet far more than the checkpoint holds: the
    # expected names are walked lazily and the first absent one is named.
    bad = copy(made["src"], tmp_path / "src")
    edit_json(bad / "config.json", lambda c: c.__setitem__("num_hidden_layers", 200))
    assert_one_line_error(run_cli("inspect", bad), "model.layers.4.input_layernorm.weight is missing",
                          "num_hidden_layers=200")


def test_fifos_named_by_a_manifest_or_opened_as_safetensors_are_refused_without_blocking(made, tmp_path):
    out = copy(made["out"], tmp_path / "out")
    rank0 = next(out.glob("model-tp2-rank0-*.safetensors"))
    rank0.unlink()
    os.mkfifo(rank0)  # nobody ever writes to it: a blocking open would wait forever
    lone = tmp_path / "lone.safetensors"
    os.mkfifo(lone)
    fifo_manifest = copy(made["out"], tmp_path / "out2")
    (fifo_manifest / "prep-manifest.json").unlink()
    os.mkfifo(fifo_manifest / "prep-manifest.json")
    code = """
import sys
import layouts
from layouts.manifest import ManifestError
from layouts.safetensors_file import SafetensorsFile, SafetensorsFileError
for what in (lambda: layouts.load_rank(sys.argv[1], 0), lambda: layouts.load_rank(sys.argv[3], 0),
             lambda: SafetensorsFile(sys.argv[2])):
    try:
        what()
        print("loaded")
    except (ManifestError, SafetensorsFileError) as e:
        print(type(e).__name__, e)
"""
    r = in_subprocess(code, out, lone, fifo_manifest, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3, r.stdout
    assert lines[0].startswith("ManifestError") and rank0.name in lines[0] and "not a regular file but a FIFO" in lines[0]
    assert lines[1].startswith("ManifestError") and "prep-manifest.json" in lines[1] and "FIFO" in lines[1]
    assert lines[2].startswith("SafetensorsFileError") and "not a regular file but a FIFO" in lines[2]


# ------------------------------------------------------------------------------ 6: paths that escape the folder
@pytest.mark.parametrize("name", ["../outside.safetensors", "ABSOLUTE", "sub/model.safetensors", ".", "..",
                                  "a\\b.safetensors", "nul\x00.safetensors", "new\nline.safetensors", ""],
                         ids=["dotdot", "absolute", "subfolder", "dot", "dotdot-alone", "backslash", "nul", "newline", "empty"])
def test_manifest_file_names_that_are_not_plain_names_in_the_folder_are_refused_on_load(made, tmp_path, name):
    out = copy(made["out"], tmp_path / "out")
    outside = shutil.copyfile(next(out.glob("model-tp2-rank0-*")), tmp_path / "outside.safetensors")
    (out / "sub").mkdir()
    shutil.copyfile(outside, out / "sub" / "model.safetensors")
    name = str(outside) if name == "ABSOLUTE" else name

    def retarget(m):
        old = m["tensors"][0]["file"]
        for t in m["tensors"]:
            if t["file"] == old:
                t["file"] = name
    edit_manifest(out, retarget)
    before = listing(out)
    assert_manifest_refused(out, "not a plain file name")
    assert listing(out) == before


def test_verify_and_revert_refuse_escaping_names_without_reading_or_writing(made, tmp_path):
    # Before: verify stat'ed a manifest "files" key of /etc/passwd and reported its size.
    out = copy(made["out"], tmp_path / "out")
    edit_manifest(out, lambda m: m["files"].__setitem__("/etc/passwd", {"rank": None, "size": 1, "tensors": 0}))
    line = assert_one_line_error(run_cli("verify", out), "prep-manifest.json", "'/etc/passwd'", "not a plain file name")
    if os.path.exists("/etc/passwd"):
        assert str(os.path.getsize("/etc/passwd")) not in line.split("'/etc/passwd'")[1]
    out2 = copy(made["out"], tmp_path / "out2")
    edit_manifest(out2, lambda m: [t.__setitem__("file", "../" + t["file"]) for t in m["tensors"]])
    dest = tmp_path / "back"
    assert_one_line_error(run_cli("revert", out2, "-o", dest), "prep-manifest.json", "not a plain file name")
    assert nothing_left(dest)
    assert_one_line_error(run_cli("verify", out2), "not a plain file name")


def test_a_symlink_out_of_the_converted_folder_is_refused_and_one_inside_is_read(made, tmp_path):
    out = copy(made["out"], tmp_path / "out")
    rank0 = next(out.glob("model-tp2-rank0-*"))
    kept = shutil.move(rank0, tmp_path / "elsewhere.safetensors")
    rank0.symlink_to(kept)
    with pytest.raises(ManifestError, match="is a symlink to .*elsewhere.safetensors, outside"):
        L.load_rank(out, 0)
    rank0.unlink()
    shutil.move(kept, out / "real-rank0.bin")
    rank0.symlink_to("real-rank0.bin")  # stays in the folder: read as the file it points to
    assert len(L.load_rank(out, 0, verify_hashes=True)) > 0


@pytest.mark.parametrize("name", ["/etc/passwd", "../elsewhere/model-00001-of-00004.safetensors",
                                  "sub/model-00001-of-00004.safetensors"], ids=["absolute", "dotdot", "subfolder"])
def test_index_entries_that_are_not_plain_names_in_the_folder_are_refused(made, tmp_path, name):
    # Before: /etc/passwd was opened as a shard, and an absolute or sub/ name crashed with KeyError.
    bad = copy(made["src"], tmp_path / "src")
    shard = "model-00001-of-00004.safetensors"
    for where in (tmp_path / "elsewhere", bad / "sub"):
        where.mkdir()
        shutil.copyfile(bad / shard, where / shard)
    edit_json(bad / INDEX, lambda ix: ix["weight_map"].update({k: name for k, v in ix["weight_map"].items() if v == shard}))
    out = tmp_path / "out"
    assert_one_line_error(run_cli("convert", bad, "-o", out), INDEX, repr(name), "not a plain file name")
    assert nothing_left(out)


def test_index_shards_and_side_files_that_are_fifos_or_symlinks_out_are_refused(made, tmp_path):
    bad = copy(made["src"], tmp_path / "src")
    shard = bad / "model-00002-of-00004.safetensors"
    kept = shutil.move(shard, tmp_path / "kept.safetensors")
    shard.symlink_to(kept)
    assert_one_line_error(run_cli("inspect", bad), shard.name, "is a symlink to", "outside")
    shard.unlink()
    os.mkfifo(shard)
    assert_one_line_error(run_cli("inspect", bad), shard.name, "not a regular file but a FIFO")
    shard.unlink()
    shutil.move(kept, shard)
    # Side files are copied into the output: one linking out of the folder would copy a secret.
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the output")
    (bad / "tokenizer.json").unlink()
    (bad / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "out"
    assert_one_line_error(run_cli("convert", bad, "-o", out), "tokenizer.json", "outside")
    assert nothing_left(out)


def _as_hub_snapshot(folder: pathlib.Path, cache: pathlib.Path) -> pathlib.Path:
    """``folder`` laid out as huggingface_hub's cache does: every file a blob named by its hash,
    the snapshot's entries relative symlinks into ../../blobs/."""
    repo = cache / "models--org--name"
    snap = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / blob)
        (snap / f.name).symlink_to(pathlib.Path("..", "..", "blobs", blob))
    return snap


def test_hub_cache_snapshots_are_read_through_their_blob_symlinks_and_only_those(made, tmp_path):
    snap = _as_hub_snapshot(made["src"], tmp_path / "hub")
    src = SourceCheckpoint(snap)
    assert len(src.tensors) == len(SourceCheckpoint(made["src"]).tensors)
    converted = _as_hub_snapshot(made["out"], tmp_path / "hub2")  # a converted checkpoint pulled from the Hub
    assert len(L.load_rank(converted, 1)) > 0
    # A snapshot entry linking out of the repo's cache folder is still refused.
    (tmp_path / "outside.json").write_text("{}")
    (snap / "tokenizer.json").unlink()
    (snap / "tokenizer.json").symlink_to(tmp_path / "outside.json")
    with pytest.raises(PrepError, match="tokenizer.json is a symlink to .*outside.json, outside .*models--org--name"):
        SourceCheckpoint(snap).side_files()


# ------------------------------------------------------------------------------ 7: loose checks
@pytest.mark.parametrize("header, data, message", [
    ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}},
     8, "tensor b at bytes [4, 8) overlaps a [0, 8)"),
    ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}},
     12, "tensor b at bytes [8, 12) leaves bytes [4, 8) of the data section to no tensor"),
    ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}, 8, "leaves bytes [0, 4)"),
    ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}},
     4, "tensor b at bytes [0, 4) overlaps a [0, 4)"),
    ({"a": {"dtype": "U8", "shape": [4.0], "data_offsets": [0, 4]}}, 4, "header entry of a is malformed"),
    ({"a": {"dtype": "U8", "shape": "4", "data_offsets": [0, 4]}}, 4, "header entry of a is malformed"),
    ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, True]}}, 1, "header entry of a is malformed"),
    ({"a": {"dtype": "U8", "shape": [1e400], "data_offsets": [0, 4]}}, 4, "header entry of a is malformed"),
    ({"a\nb": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, 4, "tensor name 'a\\nb' holds control characters"),
], ids=["overlap", "gap", "gap-at-start", "same-span-twice", "float-dim", "string-shape", "bool-offset", "infinite-dim",
        "newline-in-name"])
def test_safetensors_data_must_be_covered_exactly_by_well_typed_entries(tmp_path, header, data, message):
    text = json.dumps(header).replace("Infinity", "1e400")
    f = raw_safetensors(tmp_path / "x.safetensors", text, bytes(data))
    with pytest.raises(SafetensorsFileError) as e:
        SafetensorsFile(f)
    assert message in str(e.value) and str(f) in str(e.value) and "\n" not in str(e.value)


def test_our_streaming_writer_covers_the_data_section_exactly(tmp_path):
    # The reader now refuses gaps: what prep writes (odd sizes, empty tensors, scalars) must pass.
    from prep.safetensors_writer import StreamingSafetensorsWriter

    tensors = {"odd": torch.arange(3, dtype=torch.uint8), "bf": torch.ones(2, 3, dtype=torch.bfloat16),
               "empty": torch.empty(0, 5, dtype=torch.float32), "scalar": torch.tensor(1.5), "tail": torch.arange(5, dtype=torch.int16)}
    path = tmp_path / "w.safetensors"
    with StreamingSafetensorsWriter(path, [(n, {torch.uint8: "U8", torch.bfloat16: "BF16", torch.float32: "F32",
                                                torch.int16: "I16"}[t.dtype], tuple(t.shape)) for n, t in tensors.items()]) as w:
        for n, t in tensors.items():
            w.add(n, t)
    f = SafetensorsFile(path)
    assert all(torch.equal(f.get(n), t) for n, t in tensors.items())


@pytest.mark.parametrize("text", [
    '{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}',
    '{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"a":{"dtype":"I8","shape":[8],"data_offsets":[0,8]}}',
    '{"a":{"dtype":"U8","shape":[8],"dtype":"I8","data_offsets":[0,8]}}',
], ids=["two-spans", "same-span", "inside-an-entry"])
def test_a_header_naming_a_key_twice_is_refused(tmp_path, text):
    f = raw_safetensors(tmp_path / "x.safetensors", text, bytes(8))
    with pytest.raises(SafetensorsFileError, match="names '(a|dtype)' twice; the file is corrupt"):
        SafetensorsFile(f)


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16", "utf-32", "utf-8-sig"])
def test_headers_that_are_not_plain_utf8_are_refused(tmp_path, encoding):
    # json.loads(bytes) detects UTF-16/32 by itself: the format says UTF-8, so these are corrupt.
    text = json.dumps({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})
    f = raw_safetensors(tmp_path / "x.safetensors", text.encode(encoding), bytes(4))
    with pytest.raises(SafetensorsFileError, match="unreadable safetensors file"):
        SafetensorsFile(f)


def test_a_tensor_in_two_shards_is_refused_naming_both_files(made, tmp_path):
    bad = copy(made["src"], tmp_path / "src")
    first, second = sorted(bad.glob("model-0000*.safetensors"))[:2]
    stale = load_file(second)
    stale["model.embed_tokens.weight"] = load_file(first)["model.embed_tokens.weight"]
    save_file(stale, second, metadata={"format": "pt"})
    out = tmp_path / "out"
    assert_one_line_error(run_cli("convert", bad, "-o", out), "tensor model.embed_tokens.weight is in two shards",
                          first.name, second.name)
    assert nothing_left(out)


@pytest.mark.parametrize("case", ["listed-in-another-shard", "listed-but-absent"])
def test_an_index_that_disagrees_with_its_shards_is_refused(made, tmp_path, case):
    bad = copy(made["src"], tmp_path / "src")
    shards = sorted(p.name for p in bad.glob("model-0000*.safetensors"))

    def edit(ix):
        wm = ix["weight_map"]
        if case == "listed-in-another-shard":
            wm["model.norm.weight"] = next(s for s in shards if s != wm["model.norm.weight"])
        else:
            wm["model.ghost.weight"] = shards[0]
    edit_json(bad / INDEX, edit)
    name = "model.norm.weight" if case == "listed-in-another-shard" else "model.ghost.weight"
    assert_one_line_error(run_cli("inspect", bad), INDEX, f"lists tensor {name}",
                          "but it is in" if case == "listed-in-another-shard" else "no shard holds it")


def test_a_quark_config_next_to_one_random_tensor_is_refused_naming_the_first_missing(made, tmp_path):
    bad = tmp_path / "src"
    bad.mkdir()
    shutil.copyfile(made["src"] / "config.json", bad / "config.json")
    save_file({"random": torch.randn(4, 4).to(torch.bfloat16)}, bad / "model.safetensors")
    out = tmp_path / "out"
    assert_one_line_error(run_cli("convert", bad, "-o", out), "tensor model.embed_tokens.weight is missing")
    assert nothing_left(out)
    assert_one_line_error(run_cli("inspect", bad), "model.embed_tokens.weight is missing")


def test_a_checkpoint_missing_one_expert_is_refused_naming_it(made, tmp_path):
    bad = copy(made["src"], tmp_path / "src")
    gone = "model.layers.2.mlp.experts.5.up_proj"
    drop_tensors(bad, lambda n: n.startswith(gone + "."))
    assert_one_line_error(run_cli("inspect", bad), f"tensor {gone}.weight is missing", "n_routed_experts=8")


def test_an_mtp_layer_may_be_absent_as_a_whole_but_not_in_part(made, tmp_path):
    # transformers builds no MTP layer: amd-quark exports of its DeepseekV3 have none, though
    # their config says num_nextn_predict_layers: 1 (tests/test_quark_export.py converts one).
    partial = copy(made["src"], tmp_path / "partial")
    drop_tensors(partial, lambda n: n.startswith("model.layers.3.self_attn.o_proj."))
    assert_one_line_error(run_cli("inspect", partial), "tensor model.layers.3.self_attn.o_proj.weight is missing",
                          "num_nextn_predict_layers=1")
    absent = copy(made["src"], tmp_path / "absent")
    drop_tensors(absent, lambda n: n.startswith("model.layers.3."))
    r = run_cli("inspect", absent)
    assert r.exit_code == 0, r.output


# ------------------------------------------------------------------------------ 8: errors of the promised type
def _nested(depth: int) -> bytes:
    # padded with a string so that it passes strict_json's density check (16 bytes per container)
    # and reaches the parser, whose depth limit is what this pins
    return b'{"pad":"' + b"x" * (32 * depth) + b'","a":' + b"[" * depth + b"]" * depth + b"}"


MANIFEST_CASES = {  # name: (edit of the parsed manifest, or bytes for the whole file; what the message says)
    "not-json": (b"{not json", "not valid UTF-8 JSON"),
    "a-json-list": (b"[]", "a JSON list, not an object"),
    "utf-16": (None, "not valid UTF-8 JSON"),
    "nested-too-deeply": (_nested(100_000), "nested too deeply"),
    "tensors-not-a-list": (lambda m: m.__setitem__("tensors", {}), "tensors is dict, not a list"),
    "entry-not-an-object": (lambda m: m["tensors"].__setitem__(0, 5), "tensors[0]: entry is int, not an object"),
    "entry-without-file": (lambda m: m["tensors"][0].pop("file"), "lacks the key 'file'"),
    "shape-a-string": (lambda m: m["tensors"][0].__setitem__("shape", "abc"), "shape is 'abc', not a list"),
    "shape-of-floats": (lambda m: m["tensors"][0].__setitem__("shape", [1.5, 2]), "not a list of non-negative integers"),
    "shape-negative": (lambda m: m["tensors"][0].__setitem__("shape", [-1, 4]), "not a list of non-negative integers"),
    "rank-a-string": (lambda m: m["tensors"][0].__setitem__("rank", "0"), "rank is '0', not a non-negative integer"),
    "rank-a-bool": (lambda m: m["tensors"][0].__setitem__("rank", True), "rank is True"),
    "rank-beyond-tp": (lambda m: m["tensors"][0].__setitem__("rank", 7), "is for rank 7 of tp=2"),
    "dtype-a-number": (lambda m: m["tensors"][0].__setitem__("dtype", 8), "dtype is 8, not a string"),
    "attrs-a-list": (lambda m: m["tensors"][0].__setitem__("runtime_attrs", [1]), "runtime_attrs is [1], not an object"),
    "no-target": (lambda m: m.pop("target"), "target is None, not an object"),
    "tp-a-string": (lambda m: m["target"].__setitem__("tp", "2"), "target.tp is '2'"),
    "tp-huge": (lambda m: m["target"].__setitem__("tp", 10**9), "target.tp is 1000000000, not an integer in [1, "),
    "files-a-list": (lambda m: m.__setitem__("files", []), "files is not an object"),
    "group-file-escapes": (lambda m: m["groups"][0].__setitem__("file", "../x"), "'../x' is not a plain file name"),
    "bf16-window-outside": (lambda m: next(g for g in m["groups"] if g["kind"] == "bf16")["placements"][0]
                            .__setitem__("stop", 10**9), "a window [start, stop) inside that dim"),
}


def test_a_bf16_group_that_does_not_match_its_file_is_refused_in_one_line(made, tmp_path):
    """A rank-exact group record whose windows no longer describe the stored tensor (half of
    one split window): inverting it stops with one line naming the tensor, before any read."""
    out = copy(made["out"], tmp_path / "out")

    def halve(m):
        g = next(g for g in m["groups"] if g["kind"] == "bf16" and g["placements"][0]["dim"] == 0)
        p = g["placements"][0]
        p["stop"] = p["start"] + (p["stop"] - p["start"]) // 2
        return g["name"]

    edit_manifest(out, halve)
    assert_one_line_error(run_cli("verify", out, "--source", made["src"]), "does not match its group record")
    assert_one_line_error(run_cli("revert", out, "-o", tmp_path / "back"), "does not match its group record")


@pytest.fixture(scope="module")
def made_r1(tmp_path_factory):
    """A tiny R1-0528 source (BF16 experts in its MTP layer: stacked groups) and its tp=2 conversion."""
    root = tmp_path_factory.mktemp("hostile-r1")
    src = write_checkpoint(SynthSpec(variant="r1-0528"), root / "src")
    convert(str(src), root / "tp2", target_for(ATOM, tp=2))
    return {"src": src, "out": root / "tp2"}


def _stack(m) -> dict:
    return next(g for g in m["groups"] if g["kind"] == "bf16" and "stack" in g)["stack"]


# A stacked BF16 group's template (its expert ranges are expanded into placements by every reader).
STACK_CASES = {
    "experts-not-ranges": (lambda m: _stack(m).__setitem__("experts", [3]), "not a non-empty list of [start, stop)"),
    "experts-empty-range": (lambda m: _stack(m).__setitem__("experts", [[2, 2]]),
                            "not a non-empty list of [start, stop)"),
    "experts-overlap": (lambda m: _stack(m).__setitem__("experts", [[0, 4], [3, 8]]),
                        "overlap, touch or are out of order"),
    "experts-huge": (lambda m: _stack(m).__setitem__("experts", [[0, 10**9]]), "fills a [1000000001, "),
    "experts-one-fewer": (lambda m: _stack(m)["experts"][0].__setitem__(1, 7), "fills a [8, "),
    "shared-not-bool": (lambda m: _stack(m).__setitem__("shared", 1), "shared is 1, not true or false"),
    "window-proj-unknown": (lambda m: _stack(m)["windows"][0].__setitem__("proj", "../x"),
                            "window of '../x' needs a proj"),
    "window-outside": (lambda m: _stack(m)["windows"][0].__setitem__("stop", 10**9), "a window [start, stop) inside"),
    "windows-twice": (lambda m: _stack(m)["windows"].append(_stack(m)["windows"][0]), "name a projection twice"),
    "stack-and-placements": (lambda m: next(g for g in m["groups"] if "stack" in g).__setitem__("placements", []),
                             "either a non-empty placements list or a stack"),
}


@pytest.mark.parametrize("case", list(STACK_CASES))
def test_every_malformed_stack_record_raises_manifest_error_in_one_line(made_r1, tmp_path, case):
    out = copy(made_r1["out"], tmp_path / "out")
    edit, message = STACK_CASES[case]
    edit_manifest(out, edit)
    assert_manifest_refused(out, message)
    if case == "experts-huge":  # prep's readers turn it into one error line, before expanding anything
        assert_one_line_error(run_cli("revert", out, "-o", tmp_path / "back"), "prep-manifest.json", message)


@pytest.mark.parametrize("case", list(MANIFEST_CASES))
def test_every_malformed_manifest_raises_manifest_error_in_one_line(made, tmp_path, case):
    out = copy(made["out"], tmp_path / "out")
    edit, message = MANIFEST_CASES[case]
    if case == "utf-16":
        set_manifest(out, (out / "prep-manifest.json").read_text().encode("utf-16"))
    elif isinstance(edit, bytes):
        set_manifest(out, edit)
    else:
        edit_manifest(out, edit)
    before = listing(out)
    assert_manifest_refused(out, message)
    assert listing(out) == before
    if case in ("not-json", "rank-a-string"):  # prep's readers turn it into one error line
        assert_one_line_error(run_cli("verify", out), "prep-manifest.json", message)


@pytest.mark.parametrize("marker, message", [(b"nope", "not valid UTF-8 JSON"), (b"[1]", "a JSON list, not an object"),
                                             (_nested(100_000), "nested too deeply")], ids=["not-json", "a-list", "nested"])
def test_a_malformed_completion_marker_raises_manifest_error(made, tmp_path, marker, message):
    out = copy(made["out"], tmp_path / "out")
    (out / "prep-complete.json").write_bytes(marker)
    with pytest.raises(ManifestError) as e:
        L.load_rank(out, 0)
    assert message in str(e.value) and "prep-complete.json" in str(e.value) and "convert again" in str(e.value)


@pytest.mark.parametrize("field, value, message", [
    ("dtype", "U16", "dtype 'U16' is not a safetensors dtype prep writes"),
    ("runtime_attrs", {"view": 1}, "has runtime attribute 'view', which is not a name an engine reads"),
    ("runtime_attrs", {"__class__": 1}, "has runtime attribute '__class__'"),
])
def test_load_rank_refuses_manifest_values_it_cannot_apply(made, tmp_path, field, value, message):
    out = copy(made["out"], tmp_path / "out")
    edit_manifest(out, lambda m: m["tensors"][0].__setitem__(field, value))
    with pytest.raises(ManifestError, match=message):
        L.load_rank(out, 0)


def test_a_deeply_nested_safetensors_header_raises_safetensors_file_error(tmp_path):
    f = raw_safetensors(tmp_path / "x.safetensors", _nested(100_000), b"")
    with pytest.raises(SafetensorsFileError, match="nested too deeply"):
        SafetensorsFile(f)


# ------------------------------------------------------------------------------ revert's own reads
def test_revert_refuses_a_side_file_that_is_a_symlink_out_of_the_folder(made, tmp_path):
    out = copy(made["out"], tmp_path / "out")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for DEST")
    (out / "tokenizer_config.json").unlink()
    (out / "tokenizer_config.json").symlink_to(secret)
    dest = tmp_path / "rt"
    assert_one_line_error(run_cli("revert", out, "-o", dest), "tokenizer_config.json", "outside")
    assert nothing_left(dest)


def test_revert_refuses_a_source_tensor_larger_than_the_files_before_allocating(made, tmp_path):
    out = copy(made["out"], tmp_path / "out")
    edit_source_table(out, lambda t: t["model.norm.weight"].update(shape=[2 ** 40, 2 ** 10]))
    dest = tmp_path / "rt"
    assert_one_line_error(run_cli("revert", out, "-o", dest), "model.norm.weight", "larger than all the files")
    assert nothing_left(dest)


def test_a_malformed_source_table_is_refused_by_what_reads_it_and_costs_a_rank_load_nothing(made, tmp_path):
    # No engine loading a rank reads source.tensors (R1: 90,910 entries, ~170 ms of every
    # load_manifest while it was built whole): its records are made on first use. verify --source
    # and revert read it, and refuse a malformed entry in one line naming it.
    out = copy(made["out"], tmp_path / "out")
    edit_source_table(out, lambda t: t["model.norm.weight"].update(shape="abc"))
    m = L.load_manifest(out)
    assert L.load_rank(out, 0, manifest=m)
    with pytest.raises(ManifestError, match=r"source.tensors\['model.norm.weight'\]: shape is 'abc'"):
        m.source.tensors["model.norm.weight"]
    assert_one_line_error(run_cli("verify", out, "--source", made["src"]), "model.norm.weight", "shape is 'abc'")
    dest = tmp_path / "rt"
    assert_one_line_error(run_cli("revert", out, "-o", dest), "model.norm.weight", "shape is 'abc'")
    assert nothing_left(dest)


def test_a_rank_load_never_reads_the_source_table_and_what_needs_it_refuses_one_missing_or_changed(made, tmp_path):
    # prep-source.json (format 4) holds what revert rebuilds; the manifest, sealed by the marker,
    # holds its sha256. A rank load does not open it; verify, verify --source and revert do.
    gone = copy(made["out"], tmp_path / "gone")
    (gone / "prep-source.json").unlink()
    assert L.load_rank(gone, 1)
    assert_one_line_error(run_cli("verify", gone), "prep-source.json", "missing", "convert again")
    assert_one_line_error(run_cli("revert", gone, "-o", tmp_path / "rt1"), "prep-source.json", "missing")
    assert nothing_left(tmp_path / "rt1")

    changed = copy(made["out"], tmp_path / "changed")  # an entry edited, the manifest not resealed
    edit_json(changed / "prep-source.json", lambda t: t["tensors"]["model.norm.weight"].update(shape=[1, 2]))
    assert L.load_rank(changed, 0)
    assert_one_line_error(run_cli("verify", changed), "prep-source.json", "sha256 differs from the manifest's")
    assert_one_line_error(run_cli("verify", changed, "--source", made["src"]), "prep-source.json", "sha256 differs")
    assert_one_line_error(run_cli("revert", changed, "-o", tmp_path / "rt2"), "prep-source.json", "sha256 differs")
    assert nothing_left(tmp_path / "rt2")

    outside = tmp_path / "elsewhere.json"  # a link out of the folder, whatever it holds
    outside.write_bytes((made["out"] / "prep-source.json").read_bytes())
    linked = copy(made["out"], tmp_path / "linked")
    (linked / "prep-source.json").unlink()
    (linked / "prep-source.json").symlink_to(outside)
    assert_one_line_error(run_cli("verify", linked), "prep-source.json", "outside")


def test_the_manifest_a_rank_load_returns_reads_its_source_table_from_the_folder_afterwards(made):
    # load_rank reads the folder through /proc/self/fd/N, closed when the load ends; the source
    # table, read on first use, is then read by the folder's path (it was "missing" under the fd).
    m = L.load_rank(made["out"], 0).manifest
    info = SourceCheckpoint.open(str(made["src"])).info("model.norm.weight")
    assert m.root == made["out"] and len(m.source.tensors) == len(SourceCheckpoint.open(str(made["src"])).tensors)
    got = m.source.tensors["model.norm.weight"]
    assert (got.dtype, got.shape, got.file) == (info.dtype, tuple(info.shape), info.file)


def test_a_manifest_naming_another_file_for_its_source_table_is_refused(made, tmp_path):
    # Only prep's own name: which files of OUT are prep's (--force, clean-up) is prep's to know.
    out = copy(made["out"], tmp_path / "out")
    (out / "prep-source.json").rename(out / "config.json.bak")
    edit_manifest(out, lambda m: m["source"]["tensors_file"].update(name="config.json.bak"))
    with pytest.raises(ManifestError, match=r"source.tensors_file.name is 'config.json.bak', not 'prep-source.json'"):
        L.load_manifest(out)


@pytest.mark.parametrize("name", ["prep-manifest.json", "prep-complete.json", "prep-source.json", INDEX])
def test_a_json_file_larger_than_any_prep_reads_is_refused_before_it_is_read(made, tmp_path, name):
    # A manifest, marker or index is read whole and parsed (several times its size in objects):
    # one of terabytes (here a sparse file of 1 TiB: no disk used) is refused by its size first.
    from layouts.safe_files import MAX_JSON_BYTES

    folder = copy(made["src" if name == INDEX else "out"], tmp_path / "f")
    with open(folder / name, "r+b") as f:
        f.truncate(1 << 40)
    assert (folder / name).stat().st_size > MAX_JSON_BYTES
    if name == INDEX:
        r = run_cli("convert", folder, "-o", tmp_path / "o", "--tp", "2")
        assert_one_line_error(r, name, "more than the", "re-download it")
        assert nothing_left(tmp_path / "o")
    elif name == "prep-source.json":  # read by what needs it (verify, revert), never by a rank load
        assert L.load_rank(folder, 0)
        assert_one_line_error(run_cli("verify", folder), name, "more than the")
    else:
        with pytest.raises(ManifestError, match=f"{name}: 1099511627776 bytes, more than the"):
            L.load_manifest(folder)
        assert_one_line_error(run_cli("verify", folder), name, "more than the")


def test_a_rank_file_swapped_for_a_symlink_out_of_the_folder_after_the_check_is_refused(made, tmp_path, monkeypatch):
    # The folder's files are checked (regular, inside) when its manifest is read; one replaced by a
    # link out of the folder after that check was followed by the open. What was opened is checked
    # again by its descriptor: the same bytes outside the folder are refused, naming where they are.
    import layouts.loader as loader

    out = copy(made["out"], tmp_path / "out")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    real = loader.SafetensorsFile
    swapped = []

    def swap_then_open(path):
        name = pathlib.Path(path).name
        if not swapped and name.startswith("model-"):
            shutil.copyfile(out / name, outside / name)
            (out / name).unlink()
            (out / name).symlink_to(outside / name)
            swapped.append(name)
        return real(path)

    monkeypatch.setattr(loader, "SafetensorsFile", swap_then_open)
    with pytest.raises(ManifestError, match=r"opened as .*elsewhere.*outside the folder \(a symlink put in its place\)"):
        L.load_rank(out, 0)
    assert swapped


def test_a_manifest_of_empty_objects_is_refused_before_it_is_parsed(made, tmp_path):
    # Within the size bound, a resealed manifest padded with empty objects ("{}," is 3 bytes, ~230
    # parsed) cost each rank load 2.6 GiB at 95 MiB (2.29 GiB measured for strict_json alone).
    # Fewer than 16 bytes per object or array, or more than 2M of them, is not what prep writes.
    out = copy(made["out"], tmp_path / "out")
    raw = (out / "prep-manifest.json").read_bytes()
    set_manifest(out, raw[:-1] + b',"padding":[' + b"{}," * 200_000 + b"{}]}")
    with pytest.raises(ManifestError, match=r"prep-manifest.json: not valid UTF-8 JSON \(\d+ objects and arrays in "
                                            r"\d+ bytes \(at most 2000000, and 16 bytes each or more\)"):
        L.load_rank(out, 0)
    assert_one_line_error(run_cli("verify", out), "prep-manifest.json", "objects and arrays")


def test_a_safetensors_header_larger_than_any_real_checkpoint_needs_is_refused_before_it_is_read(made, tmp_path):
    # A header is parsed whole at ~28x its size in memory; the format allows 100 MB (2.75 GB to
    # parse, measured); prep's bound is 16 MiB, ~100x the largest R1-0528 header. The file is
    # sparse: the header length says 17 MiB and nothing of it is read.
    from layouts.safetensors_file import MAX_HEADER_BYTES

    bad = copy(made["src"], tmp_path / "bad")
    shard = bad / "model-00002-of-00004.safetensors"
    n = MAX_HEADER_BYTES + (1 << 20)
    with open(shard, "r+b") as f:
        f.write(n.to_bytes(8, "little"))
        f.truncate(8 + n + 4096)
    with pytest.raises(SafetensorsFileError, match=f"a header of {n} bytes, over prep's bound of 16 MiB"):
        SafetensorsFile(shard)
    r = run_cli("convert", bad, "-o", tmp_path / "o", "--tp", "2")
    assert_one_line_error(r, shard.name, "over prep's bound")
    assert nothing_left(tmp_path / "o")


def test_revert_refuses_a_side_file_changed_since_the_conversion(made, tmp_path):
    # revert rebuilds the source: a side file of another size than the source's was changed
    # (or is a hostile sparse terabyte, which revert once read whole) and is named, not copied;
    # the others are copied as they are (a MiB at a time).
    out = copy(made["out"], tmp_path / "out")
    with open(out / "tokenizer.json", "r+b") as f:
        f.truncate(1 << 40)
    dest = tmp_path / "rt"
    assert_one_line_error(run_cli("revert", out, "-o", dest), "tokenizer.json", "1099511627776 bytes",
                          "put the source's tokenizer.json back")
    assert nothing_left(dest)
    (out / "tokenizer.json").unlink()
    shutil.copyfile(made["src"] / "tokenizer.json", out / "tokenizer.json")
    from prep.revert import revert

    revert(str(out), dest)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (dest / f).read_bytes() == (made["src"] / f).read_bytes(), f


# ------------------------------------------------------------------------------ one error base per package
def test_errors_keep_their_type_under_one_base_per_package(made, tmp_path):
    from layouts.shuffle import LayoutConstraintError

    for cls in (ManifestError, SafetensorsFileError, LayoutConstraintError):
        assert issubclass(cls, L.LayoutsError) and issubclass(cls, ValueError)
    bad = copy(made["src"], tmp_path / "trunc")
    victim = sorted(bad.glob("model-0000*.safetensors"))[1]
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(SafetensorsFileError, match="re-download it"):  # prep adds the fix, keeps the type
        SourceCheckpoint.open(str(bad))
    with pytest.raises(LayoutConstraintError, match="choose a smaller --tp"):
        convert(str(made["src"]), tmp_path / "tp8", target_for(ATOM, tp=8))
    assert nothing_left(tmp_path / "tp8")
    assert_one_line_error(run_cli("convert", made["src"], "-o", tmp_path / "tp8", "--tp", "8"), "K % 64 == 0")


def test_an_output_whose_manifest_or_marker_is_not_a_regular_file_in_it_is_refused_at_once(made, tmp_path):
    # convert into it (--force: it would be replaced) and load it: neither blocks on a FIFO, reads
    # /dev/zero until memory runs out, nor takes a file out of the folder as the folder's.
    cases = {}
    for name in ("prep-manifest.json", "prep-complete.json"):
        for kind in ("fifo", "dev-zero", "outside"):
            out = copy(made["out"], tmp_path / f"{kind}-{name}")
            (out / name).unlink()
            if kind == "fifo":
                os.mkfifo(out / name)
            elif kind == "dev-zero":
                os.symlink("/dev/zero", out / name)
            else:
                os.symlink(shutil.copy(made["out"] / name, tmp_path / f"elsewhere-{name}"), out / name)
            cases[out] = (name, kind)
    code = """
import contextlib, io, sys
import layouts
from prep.cli import main
for out in sys.argv[2:]:
    try:
        layouts.load_rank(out, 0)
        print("loaded")
    except layouts.ManifestError as e:
        print("refused", e)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(["convert", sys.argv[1], "-o", out, "--force"], standalone_mode=True)
        except SystemExit as e:
            print("exit", e.code, err.getvalue().strip().replace("\\n", " | "))
"""
    r = in_subprocess(code, made["src"], *cases, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 * len(cases), r.stdout
    for (out, (name, kind)), loaded, converted in zip(cases.items(), lines[::2], lines[1::2]):
        assert loaded.startswith("refused") and name in loaded, loaded
        assert ("FIFO" in loaded) if kind == "fifo" else ("character device" in loaded or "symlink" in loaded), loaded
        assert converted.startswith(f"exit 1 error: ") and name in converted and " | " not in converted, converted
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in made["out"].iterdir())  # untouched


# ------------------------------------------------------------------------------ 4: a manifest checked as a whole
def _first(m, role, rank=0, layout=None):
    return next(t for t in m["tensors"] if t["role"] == role and t["rank"] == rank
                and (layout is None or t.get("layout") == layout))


def _rank0_to_rank1_file(m):
    t = _first(m, "mxfp4_weight")
    t["file"] = next(n for n, f in m["files"].items() if f["rank"] == 1)


def _duplicate(m):
    m["tensors"].append(dict(_first(m, "mxfp4_weight")))


def _unshuffled(m):
    _first(m, "mxfp4_weight", layout="preshuffle")["runtime_attrs"]["is_shuffled"] = False


def _group_layout(m):
    next(g for g in m["groups"] if g["kind"] == "linear")["layout"] = "non-shuffle"


def _dtype(m):
    _first(m, "mxfp4_weight")["dtype"] = "XX"


@pytest.mark.parametrize("edit, says", [
    (_rank0_to_rank1_file, "is for rank 0 but its file model-tp2-rank1-"),
    (_duplicate, "is recorded twice for rank 0"),
    (_unshuffled, "runtime attribute is_shuffled is False, but its layout 'preshuffle' states True"),
    (_group_layout, "is in layout 'non-shuffle', which a preshuffle/ck target does not hold for a linear group"),
    (_dtype, "dtype 'XX' is not a safetensors dtype prep writes"),
], ids=["rank0-record-in-rank1-file", "duplicate-record", "is_shuffled-false-on-preshuffle", "group-layout-edited",
        "dtype-XX"])
def test_a_manifest_edited_and_resealed_is_refused_as_a_whole_by_every_reader(made, tmp_path, edit, says):
    # load_manifest and load_rank (the engine), verify (deep and against the source) and revert:
    # each passed or wrote a wrong source before, one record at a time looking fine.
    out = copy(made["out"], tmp_path / "out")
    edit_manifest(out, edit)
    assert_manifest_refused(out, says)
    for args in (["verify", out, "--deep"], ["verify", out, "--source", made["src"]],
                 ["revert", out, "-o", tmp_path / "rt"]):
        assert_one_line_error(run_cli(*args), says)
    assert not (tmp_path / "rt").exists()


def test_convert_of_the_filesystem_root_is_one_line_not_an_internal_error(tmp_path):
    r = run_cli("convert", "/")
    assert_one_line_error(r, "/: has no folder name", "pass -o OUT")



def test_a_hub_cache_snapshot_as_source_gets_its_default_output_outside_the_cache(tmp_path, monkeypatch):
    from prep.cli import default_out

    snap = tmp_path / "hub" / "models--amd--DeepSeek-R1-0528-MXFP4" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert default_out(str(snap), "preshuffle", "ck", 8, 1) == str(work / "DeepSeek-R1-0528-MXFP4-preshuffle-tp8")
    plain = tmp_path / "models" / "r1"
    plain.mkdir(parents=True)
    assert default_out(str(plain), "preshuffle", "ck", 8, 1) == str(tmp_path / "models" / "r1-preshuffle-tp8")


@pytest.mark.parametrize("which", ["shard", "config"])
def test_a_file_the_process_may_not_read_is_told_to_check_permissions_not_to_re_download(made, tmp_path, monkeypatch,
                                                                                         which):
    # The OS's refusal is simulated (the suite runs as root, whom permissions do not stop): opening
    # that one file raises PermissionError, as it does for another user on a chmod 000 file.
    src = copy(made["src"], tmp_path / "src")
    target = next(src.glob("model-0000*.safetensors")) if which == "shard" else src / "config.json"
    real_open = os.open

    def denying(path, *args, **kwargs):
        if os.fspath(path) == str(target):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denying)
    line = assert_one_line_error(run_cli("inspect", src), target.name, "cannot be read (Permission denied)",
                                 "check its permissions")
    assert "re-download" not in line


@pytest.mark.parametrize("edit, says", [
    (lambda g: g.update(inter=10 ** 12), "inter 1000000000000"),
    (lambda g: g.update(experts=g["experts"][:3]), "3 experts"),
], ids=["inter-1e12", "experts-cut"])
def test_a_moe_group_whose_sizes_do_not_fit_its_tensors_is_refused_by_every_reader(made, tmp_path, edit, says):
    out = copy(made["out"], tmp_path / "out")
    edit_manifest(out, lambda m: edit(next(g for g in m["groups"] if g["kind"] == "moe")))
    assert_manifest_refused(out, says)
    for args in (["verify", out, "--deep"], ["revert", out, "-o", tmp_path / "rt"],
                 ["run", out, "--prompt-ids", "1,2", "--layers", "2"]):
        assert_one_line_error(run_cli(*args), says, "make w13")


@pytest.mark.parametrize("change, module", [
    ({"hidden_size": 255}, "model.embed_tokens"),
    ({"vocab_size": 5}, "model.embed_tokens"),
    ({"num_attention_heads": 2}, "q_b_proj"),
    ({"kv_lora_rank": 3}, "kv_a_proj_with_mqa"),
    ({"moe_intermediate_size": 100}, "experts.0.gate_proj"),
    ({"n_routed_experts": 3}, "n_routed_experts is 3"),
], ids=["hidden", "vocab", "heads", "kv_lora", "moe_intermediate", "experts"])
def test_a_config_whose_sizes_are_not_its_tensors_is_refused_before_converting(made, tmp_path, change, module):
    # The config.json goes out with the conversion and an engine builds its models from it: one that
    # is not the checkpoint's converted silently and failed in the engine, after it had allocated.
    src = copy(made["src"], tmp_path / "src")
    edit_json(src / "config.json", lambda c: c.update(change))
    out = tmp_path / "out"
    assert_one_line_error(run_cli("convert", src, "-o", out, "--tp", "2"), f"{src / 'config.json'}: ", module,
                          "config.json is not this checkpoint's")
    assert nothing_left(out)


def test_two_ranks_files_swapped_by_renaming_are_refused_by_every_loader(made, tmp_path):
    # Same tensor names, same sizes, manifest untouched: without the name each file carries in its
    # header (its safetensors metadata), rank 0 would load rank 1's slices and compute garbage.
    out = copy(made["out"], tmp_path / "out")
    r0, r1 = (sorted(out.glob(f"model-tp2-rank{r}-*.safetensors")) for r in (0, 1))
    assert len(r0) == len(r1) == 1
    tmp = out / "swap"
    r0[0].rename(tmp)
    r1[0].rename(r0[0])
    tmp.rename(r1[0])
    for rank in (0, 1):
        with pytest.raises(ManifestError, match="holds the tensors prep wrote as .* renamed or swapped; convert again"):
            L.load_rank(out, rank)
        with pytest.raises(ManifestError, match="renamed or swapped"):
            list(L.iter_rank_files(out, rank))
    assert SafetensorsFile(made["out"] / r0[0].name).metadata["prep_file"] == r0[0].name


def test_run_on_a_config_that_is_not_the_checkpoints_is_one_line_not_an_internal_error(made, tmp_path):
    # `prep run` builds the model from config.json: a source's is checked against its tensors (as
    # convert checks it), a converted folder's against the source's recorded hash.
    src = copy(made["src"], tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, kv_lora_rank=1000)))
    assert_one_line_error(run_cli("run", src, "--prompt-ids", "1,2", "--layers", "1"),
                          "kv_a_proj_with_mqa", "config.json is not this checkpoint's")
    out = copy(made["out"], tmp_path / "out")
    (out / "config.json").write_text(json.dumps(dict(cfg, kv_lora_rank=1000)))
    assert_one_line_error(run_cli("run", out, "--prompt-ids", "1,2", "--layers", "1"),
                          "config.json", "changed since the conversion")


def _drop_entry(tensors):
    del tensors["model.layers.1.mlp.gate.e_score_correction_bias"]


def _retype_entry(tensors):
    name = next(n for n in tensors if n.endswith("mlp.gate.weight"))
    tensors[name]["dtype"] = "F16"  # same size as BF16: revert would write the bytes under another type


@pytest.mark.parametrize("edit, says", [
    (_drop_entry, "was made from model.layers.1.mlp.gate.e_score_correction_bias, which the source tensor table "
                  "does not hold"),
    (_retype_entry, "but the source tensor table says its source"),
], ids=["entry-dropped", "dtype-changed"])
def test_a_source_table_edited_and_resealed_is_checked_against_the_tensor_records(made, tmp_path, edit, says):
    out = copy(made["out"], tmp_path / "out")
    edit_source_table(out, edit)
    for args in (["verify", out, "--source", made["src"]], ["revert", out, "-o", tmp_path / "rt"]):
        assert_one_line_error(run_cli(*args), says, "the folder was modified: convert again")
    assert not (tmp_path / "rt").exists()


def test_a_config_of_a_hundred_million_layers_is_refused_at_the_first_missing_one_in_bounded_memory(made, tmp_path):
    # The walk of what config.json implies stops at the first tensor missing; it built a list of
    # every layer index first (4 GB and 3 s for 1e8 layers before the one-line error).
    src = copy(made["src"], tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=100_000_000)))
    code = ("import resource, sys\nfrom prep.cli import main\n"
            "try:\n    main(['inspect', sys.argv[1]])\nexcept SystemExit as e:\n    code = e.code\n"
            "print(code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    r = in_subprocess(code, src)
    rc, peak_kib = r.stdout.split()[-2:]
    assert rc == "1" and "model.layers.4.input_layernorm.weight is missing" in r.stderr, r.stderr
    assert int(peak_kib) < 1 << 20, f"peak {int(peak_kib) >> 10} MiB"  # under 1 GiB (it was 4 GB)


def test_the_doors_side_file_check_names_a_missing_resized_or_edited_file(made, tmp_path):
    # What both doors run before their engine starts (ATOM's server, vLLM's loader): the source's
    # side files, by size and, where xxhash is installed, by the manifest's hash of the source's.
    from layouts.loader import side_file_problem
    from prep.testing import edit_at_same_size

    out = copy(made["out"], tmp_path / "out")
    assert side_file_problem(L.load_manifest(out), "vLLM") is None
    edit_at_same_size(out / "config.json")
    assert "config.json: its bytes differ from the source's (same size, another hash); vLLM would build" in \
        side_file_problem(L.load_manifest(out), "vLLM")
    (out / "config.json").write_bytes((made["out"] / "config.json").read_bytes() + b" ")
    assert "bytes, the source's had" in side_file_problem(L.load_manifest(out), "vLLM")
    (out / "config.json").unlink()
    assert "config.json: missing; the source had it" in side_file_problem(L.load_manifest(out), "vLLM")
