"""prep's ATOM door (prep-atom-serve) on ATOM's real server start-up, on the CPU
(harness/atom/serve.py: ATOM at the pinned commit from ../shared/oracles, aiter's GPU
kernels, the GPU, NCCL and ATOM's engine-core processes as stand-ins), and the door's checks."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

import layouts
import aiter_oracle
from conftest import _need, forked_python, need_engine_sources
from harness import report, sources
from harness.atom import serve as check_atom_serve
from layouts.engines.atom import ENV_NON_SHUFFLE, ENV_TRITON_MOE, SERVED_MOE_BACKENDS
from layouts.engines.atom import serve
from prep.testing import PRESETS, drop_tensors, edit_at_same_size
from checkpoints import write_checkpoint

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def oracle_trees(tmp_path_factory, monkeypatch):
    """ATOM's and aiter's trees; ATOM's start-ups forked from the run's server of prep's
    environment (conftest.forked_python), not each a new interpreter."""
    from harness.atom import on_cpu

    monkeypatch.setitem(check_atom_serve.LAUNCH, "run", forked_python)
    oracles = need_engine_sources()
    missing = on_cpu.missing_deps()
    _need(not missing, f"ATOM's CPU dependencies ({', '.join(missing)})", "run `bash scripts/setup_env.sh --engine atom`")
    work = tmp_path_factory.getbasetemp() / "atom-oracles"
    work.mkdir(exist_ok=True)
    return sources.trees(oracles, work)


def _convert_with_cli(src: pathlib.Path, out: pathlib.Path, *args: str) -> dict:
    """``prep convert SRC -o OUT --json ARGS``'s summary (in this process: a subprocess spent ~1.5 s
    importing torch again)."""
    from click.testing import CliRunner

    from prep.cli import main

    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(out), "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _switches(command: str) -> dict[str, str]:
    """The VAR=value words in front of the command prep convert printed."""
    env = {}
    for word in shlex.split(command):
        if "=" not in word or word.startswith("-"):
            break
        k, v = word.split("=", 1)
        env[k] = v
    return env


def _refusal(stderr: str) -> str:
    """The door's refusal: exactly one line of its own, the last (ATOM logs a line as it is imported)."""
    ours = [line for line in stderr.splitlines() if line.startswith("prep-atom-serve: ")]
    assert len(ours) == 1 and stderr.strip().splitlines()[-1] == ours[0], stderr
    return ours[0]


def _flip_last_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("variant, layout, moe_layout, mtp_head", [
    ("r1-0528", "preshuffle", "triton", False), ("mtp-moefp4", "preshuffle", "ck", True),
    ("fp8-block", "preshuffle", "triton", True)],
    ids=["r1-0528-triton-mtp-without-head", "mtp-moefp4-ck", "r1-0528-fp8-block-gfx942"])
def test_the_door_leaves_atoms_models_as_atoms_own_start_up_on_the_source_at_tp2(variant, layout, moe_layout, mtp_head,
                                                                                 tmp_path, oracle_trees):
    # R1-0528 on ATOM's Triton MoE under the seed's switches (both fusions), its MTP layer without its
    # own shared_head.head and embed_tokens (ATOM's drafter then shares the target's, warning "NOT
    # loaded" once: the door must do as ATOM's own start-up does); MTP-MoEFP4 (MXFP4 MLPs and experts,
    # FP8 per-channel attention, the MTP layer quantized and whole) on the CK MoE: ATOM pads, shuffles
    # and derives W_K / W_V from the FP8 kv_b_proj at load on both sides (its two FP8 kernels torch
    # stand-ins, named in the output), with rank 1's file holding a flipped byte, which the check must
    # find and nothing else. (One start-up pair each covers several cases: the suite's time. v2's MXFP4
    # attention and the other seed cells are run by hand: check-engine atom --serve, docs/engines.md.)
    # R1-0528 as DeepSeek released it (FP8 per 128x128 block, experts too) under the seed's command,
    # on gfx942: ATOM converts e4m3fn to e4m3fnuz (each block scale doubled), shuffles every weight and
    # expert and derives W_K / W_V with its block-scale GEMM (a torch stand-in) at load on both sides;
    # its Triton MoE switch does nothing for FP8 experts.
    fp8_block = variant == "fp8-block"
    spec = PRESETS["r1-0528-fp8"] if fp8_block else dataclasses.replace(PRESETS["tiny"], variant=variant)
    src = write_checkpoint(spec, tmp_path / "src")
    if not mtp_head:
        mtp = f"model.layers.{json.loads((src / 'config.json').read_text())['num_hidden_layers']}."
        drop_tensors(src, lambda n: n in (f"{mtp}shared_head.head.weight", f"{mtp}embed_tokens.weight"))
    out = tmp_path / "out"
    summary = _convert_with_cli(src, out, "--tp", "2", "--layout", layout, "--moe-layout", moe_layout)
    env = _switches(summary["serve"])  # the command prep convert printed: its switches and its flags
    if moe_layout == "triton":
        assert env == {ENV_TRITON_MOE: "1", "ATOM_ENABLE_DS_QKNORM_QUANT_FUSION": "1",
                       "ATOM_ENABLE_DS_INPUT_RMSNORM_QUANT_FUSION": "1",
                       **({ENV_NON_SHUFFLE: "1"} if layout == "non-shuffle" else {})}
        assert summary["serve"].endswith(f"prep-atom-serve --model {out} --tensor-parallel-size 2 --kv_cache_dtype fp8")
    else:
        assert summary["serve"].endswith(f"prep-atom-serve --model {out} --tensor-parallel-size 2")
    flipped = variant == "mtp-moefp4"  # a flipped byte in rank 1's file: the door installs it, the check sees only it
    if flipped:
        _flip_last_byte(sorted(out.glob("*rank1*.safetensors"))[-1])
    result = check_atom_serve.check(src, out, oracle_trees, tmp_path / "work", env=env,
                                    gpu_arch="gfx942" if fp8_block else "gfx950")
    ranks = result["ranks"]
    lines = [line for r in ranks for line in r.lines()] + result["failures"]
    assert not result["failures"] and len(ranks) == 2, "\n".join(lines)
    if flipped:
        assert not result["ok"] and ranks[0].ok and not ranks[1].ok, "\n".join(lines)
        said = ranks[1].problems  # what the rank's row reports: its differences alone
        assert len(said) == 2 and all("1 of" in x and "bytes differ" in x for x in said), "\n".join(lines)
        assert said[0].split(":")[1] == said[1].split(":")[1]  # one tensor, under both fills
        ranks[1].problems = []  # otherwise as rank 0: every other byte equal
    else:
        assert result["ok"], "\n".join(lines)
    assert [r.ok for r in ranks] == [True, True]
    if mtp_head:
        assert all(r.warned == "no" and "draft head its own" in r.notes for r in ranks)
    else:  # ATOM's rank 0 reports the head its drafter shares; the door's does the same
        assert ranks[0].warned == "same" and "NOT-loaded warnings: 1 (ATOM's own: 1)" in ranks[0].notes
        assert ranks[1].warned == "no" and all("draft head shared with the target" in r.notes for r in ranks)
    door = result["door"]
    assert door["listening"] and door["workers"] == [0, 0]  # ATOM's server got to uvicorn; both workers loaded
    assert {f["runner"] for r in door["ranks"] for f in r["fills"]} == {"ConvertedModelRunner"}

    if variant == "mtp-moefp4":  # ATOM's FP8 GEMM ran (as torch) on both sides to derive W_K / W_V: said
        assert "torch stand-ins computed for GPU kernels: aiter.gemm_a8w8_bpreshuffle" in "\n".join(lines)
    if fp8_block:
        assert "torch stand-ins computed for GPU kernels: aiter.gemm_a8w8_blockscale, aiter.per_group_quant_hip" \
            in "\n".join(lines)


def test_a_switch_that_does_not_read_the_layout_is_refused_before_any_weight_is_allocated(tmp_path, oracle_trees):
    src = write_checkpoint(PRESETS["tiny"], tmp_path / "src")
    out = tmp_path / "out"
    # preshuffle: ATOM's non-shuffle Triton GEMM would read garbage. TP 1: one worker process to
    # start (the check each worker makes is the same on every rank).
    _convert_with_cli(src, out, "--tp", "1")
    argv = check_atom_serve.server_argv(out)
    bad = {ENV_NON_SHUFFLE: "1", ENV_TRITON_MOE: "0"}
    # The server process refuses before ATOM starts: one line, exit status 2, no worker started.
    refused = check_atom_serve.start("door", out, argv, bad, [0], tmp_path / "server", oracle_trees)
    assert refused["returncode"] == 2 and refused["workers"] == [] and refused["ranks"] == []
    line = _refusal(refused["stderr"])
    assert f"unset {ENV_NON_SHUFFLE}" in line
    # Each worker checks again what it reads itself, before ATOM's ModelRunner allocates anything.
    ok_env = {ENV_TRITON_MOE: "0"}
    worker_refused = check_atom_serve.start("door", out, argv, ok_env, [0], tmp_path / "workers", oracle_trees,
                                            worker_env={ENV_NON_SHUFFLE: "1"})
    assert worker_refused["workers"] == [1] and len(worker_refused["ranks"]) == 1
    for rank in worker_refused["ranks"]:
        assert rank["refused"].startswith("CompatibilityError: ") and f"unset {ENV_NON_SHUFFLE}" in rank["refused"]
        assert rank["params_created"] == 0 and rank["fills"] == []  # not one parameter of ATOM's models made


def test_a_folder_missing_its_tokenizer_is_refused_in_one_line(tmp_path, oracle_trees):
    src = write_checkpoint(PRESETS["tiny"], tmp_path / "src")
    out = tmp_path / "out"
    _convert_with_cli(src, out, "--tp", "2")
    (out / "tokenizer.json").unlink()
    r = check_atom_serve.start("door", out, check_atom_serve.server_argv(out), {ENV_TRITON_MOE: "0"}, [0],
                               tmp_path / "server", oracle_trees)
    assert r["returncode"] == 2 and r["workers"] == []
    assert _refusal(r["stderr"]) == (f"prep-atom-serve: {out / 'tokenizer.json'}: missing; the source had it "
                                   f"({(src / 'tokenizer.json').stat().st_size} bytes) and ATOM's server reads it "
                                   "from --model: copy it from the source or convert again")


# ---------------------------------------------------------------------------- without ATOM
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    src = write_checkpoint(PRESETS["tiny"], root / "src")
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return src, _convert_with_cli(src, root / "out", "--tp", "2")


def test_every_serve_command_selects_a_configuration_that_reads_its_layouts():
    profile = layouts.get_engine("atom")
    for path, rule in profile.gemm_paths.items():
        for (backend, arch), moe_layout in profile.moe_layouts.items():
            for ep in (1, 2):
                cmd = profile.serve_command("x", 2, ep, rule.weight_layout, moe_layout)
                if backend not in SERVED_MOE_BACKENDS:  # the door refuses ATOM's Triton MoE (profile says why)
                    assert cmd is None
                    continue
                engine = profile.config_from_env(_switches(cmd), tp_size=2, rank=0, ep_size=ep,
                                                 gpu_arch={"gfx94": "gfx942", "gfx95": "gfx950"}[arch])
                assert engine.expected_dense_layout() == rule.weight_layout or path != engine.gemm_path
                assert engine.expected_moe_layout() == moe_layout and engine.moe_backend == backend
                assert ("--enable-expert-parallel" in cmd) == (ep > 1)


def test_the_folder_check_refuses_a_changed_side_file_and_a_common_bf16_conversion(converted, tmp_path):
    src, summary = converted
    out = tmp_path / "out"
    shutil.copytree(summary["out"], out)
    assert serve.check_folder(out).target.tp == 2
    assert (out / "chat_template.jinja").read_bytes() == (src / "chat_template.jinja").read_bytes()
    (out / "chat_template.jinja").unlink()
    with pytest.raises(serve.ServeError, match=r"chat_template.jinja: missing; the source had it \(\d+ bytes\)"):
        serve.check_folder(out)
    shutil.copy(src / "chat_template.jinja", out)
    (out / "generation_config.json").write_text("{}")
    with pytest.raises(serve.ServeError, match=r"generation_config.json: 2 bytes, the source's had \d+; copy it"):
        serve.check_folder(out)
    shutil.copy(src / "generation_config.json", out / "generation_config.json")
    edit_at_same_size(out / "config.json")  # the manifest's hash tells it, the size cannot
    with pytest.raises(serve.ServeError, match=r"config.json: its bytes differ from the source's \(same size"):
        serve.check_folder(out)
    shutil.copy(src / "config.json", out / "config.json")
    assert serve.check_folder(out).target.tp == 2
    common = tmp_path / "common"
    _convert_with_cli(src, common, "--tp", "2", "--common-bf16")
    with pytest.raises(serve.ServeError, match="converted with --common-bf16 .* convert again without --common-bf16"):
        serve.check_folder(common)
    assert serve.converted_root(src) is None and serve.converted_root(out) == out


def test_options_that_change_what_a_rank_holds_are_refused_naming_the_default():
    class Args:  # what ATOM's EngineArgs holds, defaults but one
        pipeline_parallel_size = 2

    with pytest.raises(serve.ServeError, match=r"pipeline_parallel_size = 2: pipeline parallel .* not checked .* "
                                               r"--pipeline-parallel-size left at its default \(1\)"):
        serve.check_options(Args())
    serve.check_options(object())  # fields absent (another ATOM): nothing to refuse here

    class Args:  # noqa: F811 - ATOM lower-cases and strips the MoE back end; a draft model of its own is ATOM's
        moe_backend, method, draft_model = " Standard", "eagle3", "/models/eagle3-draft"

    serve.check_options(Args())
    Args.draft_model = None
    with pytest.raises(serve.ServeError, match="--method eagle3 without --draft-model: .* serve with --method mtp"):
        serve.check_options(Args())
    Args.method, Args.hf_overrides = "mtp", {"num_hidden_layers": 2}
    with pytest.raises(serve.ServeError, match="hf_overrides = .* not checked"):
        serve.check_options(Args())

    class Args:  # noqa: F811 - a later ATOM carries the all-to-all choice under another name
        moe_all2all_backend = "mori"

    with pytest.raises(serve.ServeError, match="moe_all2all_backend = 'mori': an all-to-all .* --moe-all2all-backend"):
        serve.check_options(Args())


def test_the_mtp_draft_is_refused_for_a_folder_without_an_mtp_layer(converted, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(converted[1]["out"], out)
    manifest = serve.check_folder(out)

    class Args:
        method = "mtp"

    serve.check_draft(Args(), manifest)  # the tiny checkpoints have DeepSeek's one MTP layer
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=0)))  # as V3-style configs say

    with pytest.raises(serve.ServeError, match="--method mtp: .* holds no MTP layer .* serve it without --method mtp"):
        serve.check_draft(Args(), manifest)
    Args.method = None
    serve.check_draft(Args(), manifest)


def test_an_atom_whose_seams_differ_is_refused_naming_the_version_and_the_seam(tmp_path, oracle_trees):
    src = write_checkpoint(PRESETS["tiny"], tmp_path / "src")
    out = tmp_path / "out"
    _convert_with_cli(src, out, "--tp", "1")  # one worker process to start
    argv, env = check_atom_serve.server_argv(out), {ENV_TRITON_MOE: "0"}

    def atom_with(path: str, old: str, new: str) -> pathlib.Path:
        tree = tmp_path / f"atom-{len(list(tmp_path.glob('atom-*')))}"
        shutil.copytree(oracle_trees[0], tree)
        f = tree / path
        text = f.read_text()
        assert text.count(old) == 1
        f.write_text(text.replace(old, new))
        return tree

    # The server's seam: an ATOM whose Config names another default runner.
    tree = atom_with("atom/config.py", 'runner_qualname: str = "atom.model_engine.model_runner.ModelRunner"',
                     'runner_qualname: str = "atom.model_engine.model_runner.OtherRunner"')
    r = check_atom_serve.start("door", out, argv, env, [0], tmp_path / "server", (tree, oracle_trees[1]))
    assert r["returncode"] == 2 and r["workers"] == []
    assert _refusal(r["stderr"]) == (
        f"prep-atom-serve: ATOM from {tree}: Config.runner_qualname defaults to "
        "'atom.model_engine.model_runner.OtherRunner', not 'atom.model_engine.model_runner.ModelRunner'; "
        "prep-atom-serve was checked against ROCm/ATOM ffdf3bb5: use that ATOM, or a prep checked against yours")
    # A worker's seam: an ATOM whose load_model reads the checkpoint through another function.
    tree = atom_with("atom/model_loader/loader.py", "    loaded_weights_record = load_weights_into_model(",
                     "    loaded_weights_record = (lambda **kw: load_weights_into_model(**kw))(")
    r = check_atom_serve.start("door", out, argv, env, [0], tmp_path / "workers", (tree, oracle_trees[1]))
    assert r["workers"] == [1]
    for rank in r["ranks"]:
        assert rank["refused"] == (f"ServeError: ATOM from {tree}: load_model does not call load_weights_into_model; "
                                   "prep-atom-serve was checked against ROCm/ATOM ffdf3bb5: use that ATOM, or a prep "
                                   "checked against yours")
        assert rank["params_created"] == 0


def test_atoms_triton_moe_with_a_scale_atom_keeps_raw_is_refused_naming_the_fix():
    # ATOM shuffles a Triton MoE scale only where N % 32 == 0 and K % 256 == 0; the triton layout
    # always does: where ATOM would keep it raw the door refuses, not serves other bytes.
    from layouts.engines.atom.adapter import _triton_label
    from layouts.registry import MOE_TRITON, MOE_TRITON_GFX942

    w = torch.zeros(2, 64, 64, dtype=torch.uint8)  # K = 128
    with pytest.raises(layouts.ManifestError, match=r"ATOM keeps a \[64, 4\] expert scale raw .* --moe-layout ck"):
        _triton_label("model.layers.3.mlp.experts", "w2", w, MOE_TRITON)
    assert _triton_label("model.layers.3.mlp.experts", "w2", w, MOE_TRITON_GFX942) is None  # raw on MI300 anyway


def test_help_says_what_the_door_does_and_where_atom_is_missing_says_how_to_get_it():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # this Python has no ATOM installed
    r = subprocess.run([sys.executable, "-m", "layouts.engines.atom.serve", "--help"], capture_output=True, text=True,
                       env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "prep-atom-serve --model r1-tp8 --tensor-parallel-size 8" in r.stdout and "exit status 2" in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("ATOM is not installed in this Python")
    r = subprocess.run([sys.executable, "-m", "layouts.engines.atom.serve", "--model", "x"], capture_output=True,
                       text=True, env=env, cwd=REPO)
    assert r.returncode == 2 and r.stderr.startswith("prep-atom-serve: ATOM is not installed") and not r.stdout



def test_atoms_own_mla_derivation_equals_layouts_absorbed_kv_b(oracle_trees, tmp_path):
    # ATOM's process_weights_after_loading derives W_K / W_V from each kv_b_proj: from BF16 bytes
    # (R1-0528) as they are, from MXFP4 bytes (v2) by running kv_b_proj's GEMM on an identity, here
    # aiter's own Triton gemm_afp4wfp4 (interpreted) on ATOM's non-shuffle path.
    # layouts.absorbed_kv_b of the rank's stored bytes, put through ATOM's own FP8 quant, must give
    # the same bytes, every layer of every rank (harness/atom/install.py, each rank's "MLA:" note).
    atom, aiter = oracle_trees
    _need(aiter_oracle.triton_gemm_available(), "aiter's Triton GEMM files and triton >= 3.8")
    rc, stdout, stderr = forked_python("harness", ["check-atom-matrix", "--atom-dir", str(atom), "--aiter-dir", str(aiter),
                                                   "--work", str(tmp_path), "--only", "r1-0528 asm tp2",
                                                   "--only", "v2 triton-non-shuffle tp2"], dict(os.environ))
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    lines = stdout.splitlines()
    mla = "    MLA: ATOM's W_K/W_V equal layouts.absorbed_kv_b's through its own quantization in 3 layers"
    for config, ranks in (("r1-0528 asm tp2", 4), ("v2 triton-non-shuffle tp2", 2)):
        rows = [i for i, line in enumerate(lines) if line.startswith(config)]
        assert len(rows) == ranks and all(lines[i].endswith(" ok") and mla in lines[i + 1:i + 4] for i in rows), \
            stdout
    assert len(report.rows(stdout)) == 6, stdout
    assert "triton-non-shuffle path: aiter's gemm_afp4wfp4 (Triton, interpreted): ATOM's own call" in stdout


def test_a_missing_atom_dependency_is_one_line_naming_the_set_up(tmp_path):
    # ATOM's imports fail deep inside its tree without its CPU dependencies: the checks stop
    # first, in one line naming what is missing and the set-up that installs it.
    code = ("import pathlib; from harness.atom import on_cpu; "
            "on_cpu.ATOM_CPU_DEPS += ('no_such_module_for_this_test',); "
            f"on_cpu.install(pathlib.Path({str(tmp_path)!r}), pathlib.Path({str(tmp_path)!r}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: ATOM's code needs no_such_module_for_this_test, not installed in {sys.executable}: run "
        "`bash scripts/setup_env.sh --atom`"]
