"""The conventions every `prep` verb follows: one error style (a missing input, a usage error),
`inspect` listing every layout pair the engine reads, `run --assume-layout` warning loudly,
`run`/`compare` checking the hashes of what they read, and progress bars only on a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import pty
import re
import select
import struct
import termios
import threading

import pytest
from click.testing import CliRunner

import layouts
from layouts.engines import get_engine
from prep.cli import main
from prep.convert import convert
from prep.deepseek import target_for
from prep.testing import SynthSpec
from checkpoints import write_checkpoint

ATOM = get_engine("atom")  # the engine whose profile these tests use



@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_checkpoint(SynthSpec(variant="v2"), tmp_path_factory.mktemp("src") / "v2")


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("cv") / "tp2"
    convert(str(src), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2))
    return out


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line(r, code: int, *needles: str) -> str:
    assert r.exit_code == code, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


MISSING_INPUT = {  # each verb with an input folder that does not exist
    "inspect": ["inspect", "{missing}"],
    "convert": ["convert", "{missing}", "-o", "{tmp}/out"],
    "verify": ["verify", "{missing}"],
    "revert": ["revert", "{missing}", "-o", "{tmp}/out"],
    "run": ["run", "{missing}", "--prompt-ids", "1"],
    "compare (A)": ["compare", "{missing}", "{src}", "--prompt-ids", "1"],
    "compare (B)": ["compare", "{src}", "{missing}", "--prompt-ids", "1"],
}


@pytest.mark.parametrize("verb", MISSING_INPUT)
def test_a_missing_input_is_one_line_exit_1_and_json_under_json(verb, src, tmp_path):
    args = [a.format(missing=tmp_path / "nope", tmp=tmp_path, src=src) for a in MISSING_INPUT[verb]]
    r = invoke(*args)
    assert r.exit_code == 1 and r.stdout == "", r.output
    line = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(line) == 1 and str(tmp_path / "nope") in line[0] and "Usage" not in r.output, r.output
    j = invoke(*args, "--json")
    assert j.exit_code == 1
    assert json.loads(j.stdout) == {"ok": False, "error": line[0].removeprefix("error: "), "code": 1}
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, needle", [
    (["verify"], "Missing argument 'OUT'"),
    (["convert", "x", "--tp", "two"], "Invalid value for '--tp'"),
    (["run", "x"], "Missing option '--prompt-ids'"),
    (["inspect", "x", "--bogus"], "--bogus"),
])
def test_a_usage_error_is_one_line_exit_2_naming_the_help(args, needle):
    line = one_line(invoke(*args), 2, needle)
    assert line.endswith(f"(see prep {args[0]} --help)")
    j = invoke(*args, "--json")
    assert j.exit_code == 2 and json.loads(j.stdout)["code"] == 2 and needle in json.loads(j.stdout)["error"]


def test_help_and_version_still_exit_0():
    assert invoke("--help").exit_code == 0 and invoke("verify", "--help").exit_code == 0
    assert invoke("--version").exit_code == 0


def test_inspect_lists_every_layout_pair_the_engine_reads(src, tmp_path):
    r = invoke("inspect", src, "--json")
    assert r.exit_code == 0, r.output
    by_engine = json.loads(r.stdout)["layouts_by_tp"]
    assert set(by_engine) == {"atom", "sglang", "vllm"}  # every engine prep converts for, when none is named
    listed = by_engine["atom"]
    engine = layouts.get_engine("atom")  # every dense layout with every MoE layout but SGLang's ck-3d
    readable = {(engine.dense_layout(p), m) for p in engine.gemm_paths for m in engine.moe_layouts.values()}
    assert set(listed) == {f"{d}+{m}" for d, m in readable} and len(listed) == 2 * 3
    # The pair the issue found missing: it converts and an engine configuration reads it.
    assert listed["non-shuffle+ck"]["1"] == "ok"
    out = tmp_path / "ns-ck"
    convert(str(src), out, target_for(ATOM, layout="non-shuffle", moe_layout="ck", tp=1))
    m = layouts.load_manifest(out)
    layouts.check_compatibility(m, layouts.EngineConfig.reading(m))


def test_run_assume_layout_warns_on_stderr_that_the_logits_are_garbage(converted):
    r = invoke("run", converted, "--prompt-ids", "1,2", "--assume-layout", "non-shuffle", "--json")
    assert r.exit_code == 0, r.output
    assert "WARNING: --assume-layout non-shuffle" in r.stderr and "GARBAGE BY DESIGN" in r.stderr
    assert "garbage by design" in json.loads(r.stdout)["warning"]  # stdout is still one JSON object
    plain = invoke("run", converted, "--prompt-ids", "1,2")
    assert plain.exit_code == 0 and "WARNING" not in plain.output


def _flip_a_byte_of(folder: pathlib.Path, name: str) -> None:
    m = layouts.load_manifest(folder)
    rec = next(t for t in m.tensors if t.name == name)
    path = folder / rec.file
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + json.loads(data[8:8 + header])[name]["data_offsets"][0]] ^= 0x01
    path.write_bytes(bytes(data))


def test_run_and_compare_catch_a_flipped_byte_unless_no_verify(src, converted, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(converted, bad)
    name = "model.layers.0.self_attn.o_proj.weight"  # layer 0: every run reads it
    _flip_a_byte_of(bad, name)
    for args in (["run", bad], ["compare", src, bad]):
        one_line(invoke(*args, "--prompt-ids", "1,2"), 1, name, "does not match its manifest hash")
        r = invoke(*args, "--prompt-ids", "1,2", "--no-verify")
        assert "does not match its manifest hash" not in r.output and "not checked (--no-verify)" in r.output, r.output
    ok = invoke("run", converted, "--prompt-ids", "1,2", "--json")
    assert json.loads(ok.stdout)["hashes_checked"] > 0
    # A layer the forward does not run is not what run checks: the MTP layer (and past --layers).
    mtp = tmp_path / "mtp"
    shutil.copytree(converted, mtp)
    _flip_a_byte_of(mtp, "model.layers.1.mlp.experts.w13_weight")
    assert invoke("run", mtp, "--prompt-ids", "1", "--layers", "1").exit_code == 0
    one_line(invoke("run", mtp, "--prompt-ids", "1", "--layers", "2"), 1, "w13_weight")


@pytest.fixture(scope="module")
def zygote():
    # Each run is a real process (forked, see prep_proc) whose stderr is the terminal, without
    # paying a fresh interpreter's torch import for each of the runs below.
    from prep_proc import Zygote

    z = Zygote()
    yield z
    z.close()


def _on_a_terminal(zygote, args: list[str]) -> tuple[str, str]:
    """Run prep with stderr on a pseudo-terminal (80x24) and stdout on a file: (stdout, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    chunks, done = [], threading.Event()

    def drain():  # read while prep writes, so a full terminal buffer never blocks it
        while True:
            ready, _, _ = select.select([master], [], [], 0.05)
            if ready:
                chunks.append(os.read(master, 65536))
            elif done.is_set():
                return

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        r = zygote.run(args, dict(os.environ), stderr_to=os.ttyname(slave))
    finally:
        done.set()
        reader.join()
        os.close(slave)
        os.close(master)
    assert r.returncode == 0, (args, r.stdout, b"".join(chunks))
    return r.stdout, b"".join(chunks).decode(errors="replace")


def test_progress_bars_show_on_a_terminal_only_and_never_with_json_or_quiet(src, converted, tmp_path, zygote):
    out, err = _on_a_terminal(zygote, ["verify", str(converted), "--source", str(src)])
    assert "verify: 100%" in err and "ok: 3 files" in out
    out, err = _on_a_terminal(zygote, ["run", str(converted), "--prompt-ids", "1", "--layers", "2"])
    assert "check: 100%" in err and "forward: 100%" in err and "2/2" in err, err
    out, err = _on_a_terminal(zygote, ["revert", str(converted), "-o", str(tmp_path / "rv")])
    assert "revert: 100%" in err
    out, err = _on_a_terminal(zygote, ["inspect", str(src)])
    assert "inspect: 100%" in err
    out, err = _on_a_terminal(zygote, ["verify", str(converted), "--json"])
    assert "%|" not in err and json.loads(out)["ok"] is True
    out, err = _on_a_terminal(zygote, ["run", str(converted), "--prompt-ids", "1", "-q"])
    assert "%|" not in err and "argmax" in out
    # Not a terminal (a pipe, a log): no bar at all (and a run shorter than the interval, no line).
    r = zygote.run(["verify", str(converted)], dict(os.environ))
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_where_stderr_is_not_a_terminal_long_verbs_print_a_progress_line_per_interval(src, converted, tmp_path,
                                                                                      zygote):
    # nohup, a log file, CI: plain lines (no carriage returns) with done/total, rate and time left,
    # and one when the verb ends; stdout keeps its one result; --quiet prints none.
    env = dict(os.environ, PREP_PROGRESS_SECONDS="0")
    r = zygote.run(["convert", str(src), "-o", str(tmp_path / "o"), "--tp", "2", "--json"], env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files"] > 0 and "\r" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("convert: ")]
    assert len(lines) >= 2, r.stderr
    for line in lines[:-1]:
        assert re.fullmatch(r"convert: \d+\.\d of \d+\.\d GiB \(\d+%\), \d+\.\d\d GiB/s(, about \d+ s left)?", line), line
    assert re.fullmatch(r"convert: \d+\.\d GiB in \d+ s", lines[-1]), lines[-1]
    r = zygote.run(["verify", str(converted), "--source", str(src)], env)
    assert r.returncode == 0 and "verify: " in r.stderr and r.stdout.startswith("ok: "), r.stderr
    r = zygote.run(["run", str(converted), "--prompt-ids", "1", "--layers", "2"], env)
    assert r.returncode == 0 and "forward: " in r.stderr and " layer/s" in r.stderr, r.stderr
    r = zygote.run(["verify", str(converted), "--source", str(src), "-q"], env)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_progress_time_left_follows_the_recent_rate_not_the_average(monkeypatch, capsys):
    # verify --source hashes fast, then inverts slowly: an average from the start predicted 16 s
    # for what took 2 min 25 s. Here 90 of 100 units go in ~11 s, then 1 unit per 10 s: half a
    # minute into the slow part the time left is the slow rate's (70 s for 7 units), not ~1 s.
    from prep import progress

    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    monkeypatch.setenv("PREP_PROGRESS_SECONDS", "10")
    p = progress.Progress("verify", "log", unit="unit")
    p.total(100)
    for _ in range(9):
        clock[0] += 1.25
        p(10)
    assert capsys.readouterr().err == "verify: 80 of 100 unit (80%), 8.00 unit/s, about 2 s left\n"
    for _ in range(3):
        clock[0] += 10
        p(1)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "verify: 93 of 100 unit (93%), 0.10 unit/s, about 1 min 10 s left", last
    p.close()
    assert capsys.readouterr().err.strip() == "verify: 93 unit in 41 s"


def test_json_is_one_object_with_ok_for_every_verb_success_or_failure(src, converted, tmp_path, zygote):
    # A machine reading --json parses stdout once: one object, "ok" true with the verb's fields,
    # or false with error and code (compare over its tolerance keeps its measurements in it).
    ids = ["--prompt-ids", "1,2,3", "--layers", "1"]
    good = {"inspect": ["inspect", str(src)], "convert": ["convert", str(src), "-o", str(tmp_path / "c")],
            "verify": ["verify", str(converted)], "revert": ["revert", str(converted), "-o", str(tmp_path / "r")],
            "run": ["run", str(converted), *ids], "compare": ["compare", str(src), str(converted), *ids]}
    bad = {"inspect": ["inspect", str(tmp_path / "none")],
           "convert": ["convert", str(src), "-o", str(src)],
           "verify": ["verify", str(src)], "revert": ["revert", str(src), "-o", str(tmp_path / "r2")],
           "run": ["run", str(converted), "--prompt-ids", "1", "--prefill", "2"],
           "compare": ["compare", str(src), str(converted), *ids, "--prefill-b", "1", "--no-act-quant"]}
    for verb in good:
        r = zygote.run([*good[verb], "--json"], dict(os.environ))
        doc = json.loads(r.stdout)  # exactly one document: json.loads refuses extra data
        assert r.returncode == 0 and doc["ok"] is True, (verb, r.stdout, r.stderr)
        r = zygote.run([*bad[verb], "--json"], dict(os.environ))
        doc = json.loads(r.stdout)
        assert r.returncode == 1 and doc["ok"] is False and doc["code"] == 1 and doc["error"], (verb, r.stdout)
    assert "max_abs_diff" in doc and doc["error"].startswith("logits differ by")  # compare's measurements kept
    r = zygote.run(["verify", "--json", "--bogus"], dict(os.environ))
    assert r.returncode == 2 and json.loads(r.stdout)["ok"] is False


def test_convert_says_what_a_wrong_source_is_and_nothing_before(converted, tmp_path):
    # A converted folder given as the source is named as prep's output of its source (it said
    # "no model.safetensors.index.json"); a missing source without -o is the error alone (the
    # default OUT's note came first).
    r = invoke("convert", converted, "-o", tmp_path / "o")
    one_line(r, 1, f"{converted}: is prep's conversion of ", "not a Quark source", "prep revert")
    r = invoke("convert", tmp_path / "missing")
    one_line(r, 1, "no such directory")


@pytest.mark.parametrize("env, why", [
    ({"HF_HUB_OFFLINE": "1"}, "not in the local hub cache, and HF_HUB_OFFLINE is set"),
    ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "the hub could not be reached and the repo is not in the local hub cache"),
])
def test_a_repo_id_that_cannot_be_resolved_says_how_to_work_without_the_hub(tmp_path, zygote, env, why):
    # Offline, or no network: the error names the case and the ways out (a local folder, or the
    # hub cache with HF_HUB_OFFLINE), for every verb that takes a source.
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), **env}
    env.pop("HF_HUB_OFFLINE", None) if "HF_ENDPOINT" in env else None
    for verb in (["inspect"], ["convert"], ["run", "--prompt-ids", "1"]):
        r = zygote.run([verb[0], "someorg/some-model", *verb[1:]], env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, (verb, r.stderr)
        assert lines[0].startswith(f"error: someorg/some-model: {why}; ") and "local folder" in lines[0], lines[0]
        assert "HF_HUB_OFFLINE=1" in lines[0] and "`hf download" in lines[0]


def test_inspect_of_a_repo_id_reads_headers_from_the_hub_not_the_weights(tmp_path):
    # Against a local stand-in of the hub's file API (tests/hub_server.py, real HTTP): inspect of
    # a repo id not in the cache fetches config, index and each shard's header by ranged reads
    # (< 1% of the checkpoint's bytes, here 2 shards of 26 and 34 MB), says what a conversion writes,
    # and describes the checkpoint as the local folder is described.
    import subprocess
    import sys

    from hub_server import HubServer

    src = write_checkpoint(SynthSpec(variant="v2", hidden_size=1024, moe_intermediate_size=1024, num_shards=2,
                                     random_bytes=True),
                           tmp_path / "src")
    repo = "someorg/tiny-mxfp4"
    local = json.loads(invoke("inspect", src, "--json").stdout)
    with HubServer(src, repo) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_DISABLE_XET": "1"}
        env.pop("HF_HUB_OFFLINE", None)
        r = subprocess.run([sys.executable, "-m", "prep", "inspect", repo, "--json"], env=env, capture_output=True,
                           text=True, cwd=tmp_path)
        first = list(hub.requests)
        text = subprocess.run([sys.executable, "-m", "prep", "inspect", repo], env=env, capture_output=True,
                              text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout)
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert got["read_from_hub"]["shards"] == len(shards) and got["path"] == repo
    for key in ("tensors", "bytes", "files", "layouts_by_tp", "mxfp4_modules_by_kind", "output_bytes_by_tp"):
        assert got[key] == local[key], key
    total = sum(p.stat().st_size for p in src.iterdir())
    read = sum(n for _, _, n in first)
    assert read < total / 100, (read, total)  # the headers, the config and the index: not the weights
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # nothing of the weights cached
    assert text.returncode == 0 and text.stdout.startswith(f"{repo} (read from the hub: config, index and "
                                                           f"{len(shards)} shard headers, ")
    assert "nothing downloaded)" in text.stdout.splitlines()[0] and text.stderr == ""
    assert "  time: about that of copying " in text.stdout


def test_the_prep_command_leaves_at_once_with_its_output_whole_and_its_exit_status(src, tmp_path):
    # `prep` (prep.cli.run) skips the interpreter's shutdown once a verb returns (0.25-0.45 s of
    # finalizing torch): what it printed must still arrive whole through a pipe and into a file,
    # with the exit status every verb gives (0, 1 for an error, 2 for a usage error).
    import subprocess
    import sys

    def prep(*args, **kw):
        return subprocess.run([sys.executable, "-m", "prep", *args], capture_output=True, text=True, cwd=tmp_path, **kw)

    r = prep("inspect", str(src), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["tensors"] > 0, r.stderr
    with open(tmp_path / "out.json", "w") as f:  # stdout a file: flushed before the process goes
        code = subprocess.run([sys.executable, "-m", "prep", "inspect", str(src), "--json"], stdout=f,
                              cwd=tmp_path).returncode
    # the same answer, but for the disk's free space, which other processes change meanwhile
    piped, to_file = json.loads(r.stdout), json.loads((tmp_path / "out.json").read_text())
    assert code == 0 and piped.pop("free_bytes_here") >= 0 and to_file.pop("free_bytes_here") >= 0
    assert to_file == piped
    r = prep("verify", str(tmp_path / "nowhere"))
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1 and not r.stdout
    r = prep("convert", "--no-such-option")
    assert r.returncode == 2 and "no such option" in r.stderr.lower()
    r = prep("--version")
    assert r.returncode == 0 and r.stdout.startswith("prep, version ")
    # a verb whose reader went away (`prep inspect X | head -1` with more to print than the pipe
    # holds): a quiet 141, as a process the pipe's SIGPIPE ends, not "error: a file: Broken pipe"
    verb = ("import prep.cli.app as c\n@c._fail_cleanly\ndef inspect():\n    raise BrokenPipeError(32, 'Broken pipe')\n"
            "inspect()")
    r = subprocess.run([sys.executable, "-c", verb], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 141 and r.stderr == "" and r.stdout == "", r.stderr


def test_inspect_for_one_engine_says_where_only_expert_parallel_converts_and_convert_names_it(src, tmp_path):
    # vLLM's ck-3d MoE does not split the tiny checkpoint's experts over TP 2 (K/32 % 8), but whole
    # experts per rank (--ep 2) convert: inspect says so for vLLM, and convert's refusal names it.
    r = invoke("inspect", src, "--engine", "vllm", "--json")
    assert r.exit_code == 0, r.output
    assert list(json.loads(r.stdout)["layouts_by_tp"]) == ["vllm"]
    assert json.loads(r.stdout)["layouts_by_tp"]["vllm"]["non-shuffle-t+ck-3d"]["2"] == "ok with --ep 2"
    r = invoke("inspect", src, "--engine", "vllm")
    assert "  vLLM (--engine vllm), layouts by TP size:" in r.stdout and "tp 1, 2 (with --ep 2)" in r.stdout
    r = invoke("convert", src, "-o", tmp_path / "out", "--engine", "vllm", "--tp", "2")
    assert r.exit_code == 1 and r.stderr.strip().endswith("with --ep 2 (whole experts per rank) this converts")
    assert invoke("convert", src, "-o", tmp_path / "out", "--engine", "vllm", "--tp", "2", "--ep", "2").exit_code == 0
    r = invoke("inspect", src, "--engine", "nope")
    assert r.exit_code == 1 and "unknown engine 'nope'; known: atom, sglang, vllm" in r.stderr
