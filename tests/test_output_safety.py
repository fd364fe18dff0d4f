"""The fault and abuse suite for what prep writes: real `prep` processes on real folders with
unrelated files beside them, killed with SIGKILL at every step of a write (through the
``PREP_TEST_KILL_AT`` hook in prep.fileops), two runs racing for one OUT, resumes against a
changed source, and reverts of damaged checkpoints. Each case asserts the message, the exit
code, that every file that existed before is byte-identical afterwards, and that nothing
partial is left."""

import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from layouts.manifest import expand_names, load_manifest
from layouts.engines import get_engine
from prep.convert import convert
from prep.deepseek import target_for
from prep.testing import SynthSpec, as_format_3, edit_at_same_size
from checkpoints import write_checkpoint

ATOM = get_engine("atom")  # the engine whose profile these tests use

ENV = {k: v for k, v in os.environ.items() if not k.startswith("PREP_TEST_")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("srcs")
    return {"a": write_checkpoint(SynthSpec(variant="v2"), root / "a"),
            "b": write_checkpoint(SynthSpec(variant="v2", seed=1), root / "b")}


_ZYGOTE = {}


@pytest.fixture(scope="module", autouse=True)
def zygote():
    from prep_proc import Zygote

    _ZYGOTE["z"] = z = Zygote()
    yield z
    z.close()


def prep(*args, kill_at=None, interrupt_at=None, no_exchange=False, cwd=None, wait=True):
    """Run the real CLI in a process of its own (forked from the zygote; ``wait=False``: a
    fresh interpreter, to run beside another)."""
    env = dict(ENV)
    if kill_at:
        env["PREP_TEST_KILL_AT"] = kill_at
    if no_exchange:
        env["PREP_TEST_NO_EXCHANGE"] = "1"
    if interrupt_at:
        env["PREP_TEST_INTERRUPT_AT"] = interrupt_at
    args = [str(a) for a in args]
    if wait:
        return _ZYGOTE["z"].run(args, env, str(cwd) if cwd else None)
    cmd = [sys.executable, "-m", "prep.cli", *args]
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT (finish) prints every thread's stack
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    """A ``prep(..., wait=False)`` process's exit status and stderr, its pipes read as it runs
    (``wait`` with full pipes would hang both sides); one that does not finish is stopped with
    SIGABRT and the test fails with the stacks its threads were in."""
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGABRT)
        _, err = p.communicate()
        raise AssertionError(f"{' '.join(map(str, p.args))} did not finish in {timeout} s; its threads:\n{err[-8000:]}")
    return p.returncode, err


def snapshot(root: pathlib.Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256), hidden ones included."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def one_line_error(r, *needles, code=1):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def complete(out: pathlib.Path) -> str:
    """The manifest sha256 of a finished output at ``out`` whose every tensor verifies."""
    load_manifest(out).verify_hashes()
    return json.loads((out / "prep-complete.json").read_text())["manifest_sha256"]


def no_work_left(out: pathlib.Path) -> bool:
    return not out.with_name(f".{out.name}.prep").exists()


@pytest.fixture
def workspace(tmp_path, sources):
    """A folder holding a copy of source A, an unrelated file and a previous output of prep."""
    ws = tmp_path / "ws"
    ws.mkdir()
    shutil.copytree(sources["a"], ws / "src")
    (ws / "notes.txt").write_text("the user's own notes")
    convert(str(ws / "src"), ws / "out", target_for(ATOM, tp=1))
    return ws


# ---------------------------------------------------------------------------- 1. --force
@pytest.mark.parametrize("args, needle", [
    (["convert", "src", "-o", ".", "--force"], "contains the input"),
    (["convert", "ws/src", "-o", "ws", "--force"], "contains the input"),
    (["convert", "src", "-o", "src", "--force"], "is the input"),
    (["convert", "src", "-o", "src/sub"], "lies inside the input"),
    (["revert", "out", "-o", "out", "--force"], "is the input"),
    (["revert", "out", "-o", "out/rt"], "lies inside the input"),
    (["convert", "src", "-o", "notes.txt", "--force"], "not a folder"),
])
def test_output_that_is_or_holds_or_lies_in_the_input_is_refused_untouched(workspace, args, needle):
    cwd = workspace.parent if args[1].startswith("ws/") else workspace
    before = snapshot(workspace)
    one_line_error(prep(*args, cwd=cwd), needle)
    assert snapshot(workspace) == before


def test_force_never_replaces_a_folder_with_files_prep_did_not_write(workspace, tmp_path):
    before = snapshot(workspace)
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "data.bin").write_bytes(b"\0" * 10)
    one_line_error(prep("convert", workspace / "src", "-o", stranger, "--force"), "'data.bin'", "not an output of prep")
    assert (stranger / "data.bin").read_bytes() == b"\0" * 10
    # A previous output of prep with one file of the user's put into it: refused too.
    (workspace / "out" / "my-eval.txt").write_text("keep me")
    before = snapshot(workspace)
    one_line_error(prep("convert", workspace / "src", "-o", workspace / "out", "--force"), "'my-eval.txt'",
                   "prep did not write it")
    assert snapshot(workspace) == before and no_work_left(workspace / "out")


@pytest.mark.parametrize("name", ["tokenizer.model", "modeling_deepseek.py", "special_tokens_map.json"])
def test_force_never_deletes_a_file_named_like_a_side_file_the_source_did_not_have(workspace, name):
    # prep copies a side file only where the source has one: the same name put there by the user
    # is the user's (the source here has tokenizer.json, not tokenizer.model).
    out = workspace / "out"
    (out / name).write_text("mine")
    before = snapshot(workspace)
    one_line_error(prep("convert", workspace / "src", "-o", out, "--force"), repr(name), "prep did not write it")
    assert snapshot(workspace) == before and no_work_left(out)


@pytest.mark.parametrize("edit", ["longer", "same size"])
def test_force_never_deletes_a_side_file_edited_since_prep_copied_it(workspace, edit):
    out = workspace / "out"
    side = out / "generation_config.json"
    if edit == "longer":
        side.write_text(side.read_text() + "\n")  # tuned
    else:
        edit_at_same_size(side)  # the size alone cannot tell it: the manifest's hash does
    before = snapshot(workspace)
    one_line_error(prep("convert", workspace / "src", "-o", out, "--force"), "'generation_config.json'",
                   "edited since prep wrote it")
    assert snapshot(workspace) == before and no_work_left(out)


def test_verify_and_revert_refuse_a_side_file_edited_at_the_same_size(workspace, tmp_path):
    out = workspace / "out"
    edit_at_same_size(out / "config.json")
    one_line_error(prep("verify", out), "config.json: its bytes differ from the source's", "put the source's")
    one_line_error(prep("revert", out, "-o", tmp_path / "rt"), "config.json: its bytes differ from the source's")
    assert not (tmp_path / "rt").exists()


def test_revert_force_never_deletes_a_side_file_edited_since_revert_wrote_it(workspace, tmp_path):
    rt = tmp_path / "rt"
    assert prep("revert", workspace / "out", "-o", rt).returncode == 0
    edit_at_same_size(rt / "config.json")  # the user's edit of the rebuilt checkpoint, any size
    before = snapshot(tmp_path)
    one_line_error(prep("revert", workspace / "out", "-o", rt, "--force"), "'config.json'", "prep did not write it")
    assert snapshot(tmp_path) == before


def test_force_trusts_only_a_sealed_manifest_and_of_it_only_the_files_prep_writes(workspace):
    from layouts.manifest import manifest_hash

    out = workspace / "out"
    (out / "precious.txt").write_text("keep me")
    m = json.loads((out / "prep-manifest.json").read_text())
    m["files"]["precious.txt"] = next(iter(m["files"].values()))
    raw = json.dumps(m).encode()
    (out / "prep-manifest.json").write_bytes(raw)  # its completion marker no longer seals it
    before = snapshot(workspace)
    one_line_error(prep("convert", workspace / "src", "-o", out, "--force"), "does not seal")
    assert snapshot(workspace) == before
    marker = json.loads((out / "prep-complete.json").read_text())
    marker["manifest_sha256"] = manifest_hash(raw)  # sealed again: a manifest naming a file prep never writes
    (out / "prep-complete.json").write_text(json.dumps(marker))
    before = snapshot(workspace)
    one_line_error(prep("convert", workspace / "src", "-o", out, "--force"), "'precious.txt'", "prep did not write it")
    assert snapshot(workspace) == before and (out / "precious.txt").read_text() == "keep me"


def test_force_counts_the_source_table_as_prep_s_only_where_the_sealed_manifest_names_it(workspace):
    # prep-source.json is prep's (format 4) because the sealed manifest says it wrote it; beside a
    # manifest holding its table inside (version 3 and before), a file of that name is the user's.
    out = workspace / "out"
    as_format_3(out)
    (out / "prep-source.json").write_text("my notes")
    before = snapshot(workspace)
    one_line_error(prep("convert", workspace / "src", "-o", out, "--force"), "'prep-source.json'", "prep did not write it")
    assert snapshot(workspace) == before
    (out / "prep-source.json").unlink()  # without it, the version-3 output is prep's and is replaced
    assert prep("convert", workspace / "src", "-o", out, "--force").returncode == 0
    assert json.loads((out / "prep-manifest.json").read_text())["format_version"] == 4 and no_work_left(out)


def test_non_empty_output_needs_force_and_force_replaces_only_prep_files(workspace):
    out = workspace / "out"
    one_line_error(prep("convert", workspace / "src", "-o", out, "--tp", "2"), "previous output of prep", "--force")
    old = complete(out)
    others = {k: v for k, v in snapshot(workspace).items() if not k.startswith("out/")}
    r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--force")
    assert r.returncode == 0, r.stderr
    assert complete(out) != old and no_work_left(out)
    assert {k: v for k, v in snapshot(workspace).items() if not k.startswith("out/")} == others


@pytest.mark.parametrize("exchange", [True, False])
def test_what_is_put_into_out_while_prep_converts_survives_the_swap_and_is_named(workspace, monkeypatch, exchange):
    # After the last check under the lock, before the swap: a user's file and folder land in the
    # previous output. Deleting that output deletes prep's files only; theirs go back into OUT,
    # and one whose name the new output holds waits in the work folder's kept/.
    from prep import outdir

    out, real = workspace / "out", outdir.kill_point

    def drop(name):
        if name == "swap-state-written":
            (out / "late.txt").write_text("written while prep converted")
            (out / "late-dir").mkdir()
            (out / "late-dir" / "x.bin").write_bytes(b"x" * 10)
            (out / "model-tp2-rank1-00001-of-00001.safetensors").write_bytes(b"the user's, same name as a new file")
        real(name)

    monkeypatch.setattr(outdir, "kill_point", drop)
    if not exchange:
        monkeypatch.setenv("PREP_TEST_NO_EXCHANGE", "1")
    notes = []
    convert(str(workspace / "src"), out, target_for(ATOM, tp=2), force=True, notify=notes.append)
    complete(out)
    assert (out / "late.txt").read_text() == "written while prep converted"
    assert (out / "late-dir" / "x.bin").read_bytes() == b"x" * 10
    kept = out.with_name(".out.prep") / "kept" / "model-tp2-rank1-00001-of-00001.safetensors"
    assert kept.read_bytes() == b"the user's, same name as a new file"
    assert any("'late.txt'" in n and "kept there beside the new output" in n for n in notes), notes
    assert any(str(kept) in n for n in notes), notes
    # the next --force sees the user's files in OUT and refuses rather than deleting them
    one_line_error(prep("convert", workspace / "src", "-o", out, "--force"), "prep did not write it")


def test_a_refusal_at_the_swap_keeps_the_finished_output_for_resume(workspace, monkeypatch):
    # A file put into OUT while prep converts makes the last check refuse the swap: the whole new
    # output is finished in staging by then. It was thrown away; it is kept, and a --resume once
    # the file is moved away swaps it in without converting anything again.
    import prep.convert as pconvert
    from prep.errors import PrepError

    out, real = workspace / "out", pconvert.kill_point

    def drop(name):
        if name == "marker-written":
            (out / "late.txt").write_text("mine")
        real(name)

    monkeypatch.setattr(pconvert, "kill_point", drop)
    with pytest.raises(PrepError, match="'late.txt'.*the finished files are kept in .*--resume"):
        convert(str(workspace / "src"), out, target_for(ATOM, tp=2), force=True)
    monkeypatch.setattr(pconvert, "kill_point", real)
    assert (out / "late.txt").read_text() == "mine"
    (out / "late.txt").unlink()
    r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--force", "--resume", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["reused_files"] == summary["files"] and no_work_left(out)
    complete(out)


def test_an_undeletable_file_of_the_previous_output_says_the_new_one_is_in_place(workspace, monkeypatch):
    # An immutable file in the old output failed the clean-up after the swap, and every later
    # --force, without saying that OUT already holds the new output.
    from prep import outdir
    from prep.errors import PrepError

    out, real = workspace / "out", os.unlink
    stuck = next(p.name for p in out.iterdir() if p.name.startswith("model-"))

    def unlink(path, *a, **k):
        if os.path.basename(path) == stuck and ".out.prep" in str(path):
            raise PermissionError(1, "Operation not permitted")
        return real(path, *a, **k)

    monkeypatch.setattr(outdir.os, "unlink", unlink)
    for _ in range(2):  # the run that swapped, then the next one that finds the remains
        with pytest.raises(PrepError, match=f"holds the new output, complete; the previous output's {stuck} cannot "
                                            "be deleted .*Operation not permitted.*chattr -i"):
            convert(str(workspace / "src"), out, target_for(ATOM, tp=2), force=True)
        complete(out)
        assert json.loads((out / "prep-manifest.json").read_text())["target"]["tp"] == 2
    monkeypatch.setattr(outdir.os, "unlink", real)
    assert prep("convert", workspace / "src", "-o", out, "--tp", "2", "--force").returncode == 0
    assert no_work_left(out)


def test_force_replaces_a_previous_revert_output_and_an_empty_folder(workspace):
    rt = workspace / "rt"
    assert prep("revert", workspace / "out", "-o", rt).returncode == 0
    one_line_error(prep("revert", workspace / "out", "-o", rt), "previous output of prep")
    assert prep("revert", workspace / "out", "-o", rt, "--force").returncode == 0
    assert (rt / "prep-revert.json").is_file() and no_work_left(rt)
    (workspace / "empty").mkdir()
    assert prep("convert", workspace / "src", "-o", workspace / "empty").returncode == 0
    complete(workspace / "empty")
    # A revert marker naming a file revert never writes does not make that file prep's.
    (rt / "precious.txt").write_text("keep me")
    marker = json.loads((rt / "prep-revert.json").read_text())
    (rt / "prep-revert.json").write_text(json.dumps(dict(marker, files=marker["files"] + ["precious.txt"])))
    before = snapshot(workspace)
    one_line_error(prep("revert", workspace / "out", "-o", rt, "--force"), "'precious.txt'", "prep did not write it")
    assert snapshot(workspace) == before


# ----------------------------------------------------------- kill -9 at every step of a write
KILL_POINTS = ["file-written", "source-table-written", "marker-written", "swap-state-written", "exchanged", "old-moved",
               "old-half-deleted", "old-manifest-deleted", "final-records-removed", "final-state-removed"]


@pytest.mark.parametrize("point", KILL_POINTS + ["moved-aside"])
def test_kill_at_any_step_of_a_forced_replace_leaves_old_or_new_complete_and_the_next_run_finishes(workspace, point):
    out = workspace / "out"
    old = complete(out)
    others = {k: v for k, v in snapshot(workspace).items() if not k.startswith(("out/", ".out.prep/"))}
    r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--force", kill_at=point,
             no_exchange=point == "moved-aside")
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert {k: v for k, v in snapshot(workspace).items() if not k.startswith(("out/", ".out.prep/"))} == others
    if point == "moved-aside":  # the one instant with no OUT at its path: two renames, no exchange
        assert not out.exists()
    else:
        assert complete(out) == old or point in ("exchanged", "old-moved", "old-half-deleted", "old-manifest-deleted",
                                                 "final-records-removed", "final-state-removed")
    r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--force", "--resume", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    new = complete(out)
    assert new != old and no_work_left(out)
    if point != "file-written":
        assert summary["reused_files"] == summary["files"]  # complete before the kill: nothing redone
    else:
        assert 0 < summary["reused_files"] < summary["files"]
    assert {k: v for k, v in snapshot(workspace).items() if not k.startswith("out/")} == others


def test_resume_on_an_output_this_run_already_made_has_nothing_to_do(workspace):
    # The completion marker keeps the run's key (options, plan, source identities): a --resume
    # that finds OUT finished by the same run (completed, or killed after its work folder's
    # state was gone) checks OUT's hashes and writes nothing; any other run is refused or redone.
    out = workspace / "out2"
    assert prep("convert", workspace / "src", "-o", out, "--tp", "2").returncode == 0
    made = complete(out)
    inodes = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--resume", "--json")
    assert r.returncode == 0, r.stderr
    assert "already complete" in r.stderr and "nothing to do" in r.stderr
    summary = json.loads(r.stdout)
    assert summary["reused_files"] == summary["files"]
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == inodes and no_work_left(out)
    # Other options: OUT is a previous output like any other (refused without --force).
    one_line_error(prep("convert", workspace / "src", "-o", out, "--tp", "1", "--resume"),
                   "is a previous output of prep", "--force")
    # OUT's bytes damaged since: converted again, not accepted.
    victim = next(out.glob("model-tp2-rank1-*.safetensors"))
    with open(victim, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--resume", "--force", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["reused_files"] == 0, r.stderr
    assert complete(out) == made
    # A source file changed since (its identity, not its bytes here: a copy or touch): converted again.
    shard = next((workspace / "src").glob("model-*.safetensors"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--resume", "--force", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["reused_files"] == 0, r.stderr
    assert "already complete" not in r.stderr


@pytest.mark.parametrize("leftover", ["kill-after-state", "staging-without-state"])
def test_a_run_killed_as_it_starts_never_blocks_the_next_one(workspace, leftover):
    # Before: staging was made before its state; a kill between them left .OUT.prep holding
    # files but no state.json, and every later run refused until it was removed by hand.
    out = workspace / "out"
    old = complete(out)
    if leftover == "kill-after-state":
        r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--force", kill_at="state-written")
        assert r.returncode == -signal.SIGKILL, r.stderr
    else:  # what that window (or an earlier prep) left: prep's own folders, no state
        work = workspace / ".out.prep"
        (work / "staging").mkdir(parents=True)
        (work / "records").mkdir()
        (work / "staging" / "model-tp2-rank0-00001-of-00001.safetensors").write_bytes(b"partial")
    assert complete(out) == old
    r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--force")
    assert r.returncode == 0, r.stderr
    assert complete(out) != old and no_work_left(out)


def test_a_work_folder_with_files_prep_does_not_make_there_is_still_refused(workspace):
    work = workspace / ".out.prep"
    work.mkdir()
    (work / "notes.txt").write_text("someone's")
    r = prep("convert", workspace / "src", "-o", workspace / "out", "--tp", "2", "--force")
    one_line_error(r, "['notes.txt'] but no state.json", "remove that folder yourself")
    assert (work / "notes.txt").read_text() == "someone's"


def test_a_kill_after_the_swap_leaves_the_new_output_complete(workspace):
    out = workspace / "out"
    old = complete(out)
    r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--force", kill_at="old-half-deleted")
    assert r.returncode == -signal.SIGKILL
    assert complete(out) != old  # already the new one; the old one's remains are in .out.prep/old
    # Any later run on OUT (here a plain verify does not; the next convert does) cleans them up.
    assert prep("convert", workspace / "src", "-o", out, "--tp", "2", "--force").returncode == 0
    assert no_work_left(out)


def test_a_killed_revert_leaves_dest_absent_or_complete_and_the_next_revert_starts_over(workspace):
    rt = workspace / "rt"
    r = prep("revert", workspace / "out", "-o", rt, kill_at="swap-state-written")
    assert r.returncode == -signal.SIGKILL and not rt.exists()
    assert prep("revert", workspace / "out", "-o", rt).returncode == 0
    marker = (rt / "prep-revert.json").read_bytes()
    r = prep("revert", workspace / "out", "-o", rt, "--force", kill_at="exchanged")
    assert r.returncode == -signal.SIGKILL and (rt / "prep-revert.json").read_bytes() == marker
    assert prep("revert", workspace / "out", "-o", rt, "--force").returncode == 0
    assert no_work_left(rt) and (rt / "prep-revert.json").read_bytes() == marker


# ---------------------------------------------------------------------- 2. --resume identity
def test_verify_and_run_on_an_interrupted_output_point_to_resume(sources, tmp_path):
    out = tmp_path / "out"
    r = prep("convert", sources["a"], "-o", out, "--tp", "2", kill_at="file-written")
    assert r.returncode == -signal.SIGKILL and not out.exists()
    for verb in (("verify", out), ("run", out, "--prompt-ids", "1", "--layers", "1")):
        one_line_error(prep(*verb), "was interrupted", ".out.prep", "--resume")
    assert prep("convert", sources["a"], "-o", out, "--tp", "2", "--resume").returncode == 0
    assert prep("verify", out).returncode == 0


def test_resume_with_another_source_writes_every_file_again(sources, tmp_path):
    out = tmp_path / "out"
    r = prep("convert", sources["a"], "-o", out, "--tp", "2", kill_at="file-written")
    assert r.returncode == -signal.SIGKILL
    r = prep("convert", sources["b"], "-o", out, "--tp", "2", "--resume", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["reused_files"] == 0 and "source file" in r.stderr
    assert prep("verify", out, "--source", sources["b"]).returncode == 0


def test_resume_after_one_source_byte_changed_redoes_exactly_the_files_that_read_it(sources, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(sources["a"], src)
    r = prep("convert", src, "-o", out, "--tp", "2", kill_at="marker-written")  # every file finished
    assert r.returncode == -signal.SIGKILL
    # The shard holding lm_head and the final norm: read by the files that hold a slice or a copy
    # of one of its tensors (every rank's, rank-exact), and by no other.
    victim = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    staged = out.parent / f".{out.name}.prep" / "staging"
    m = json.loads((staged / "prep-manifest.json").read_text())
    table = json.loads((staged / "prep-source.json").read_text())["tensors"]
    readers = {t["file"] for t in m["tensors"]
               if any(table[n]["file"] == victim.name for n in expand_names(t["sources"]))}
    assert readers and len(readers) < len(m["files"])
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one byte, in the middle of the data, where sampling may not look
    victim.write_bytes(bytes(data))
    r = prep("convert", src, "-o", out, "--tp", "2", "--resume", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["files"] - s["reused_files"] == len(readers), s
    assert victim.name in r.stderr and sorted(readers)[0] in r.stderr
    assert prep("verify", out, "--source", src).returncode == 0


def test_resume_with_other_options_is_refused_naming_the_option(sources, tmp_path):
    out = tmp_path / "out"
    assert prep("convert", sources["a"], "-o", out, "--tp", "2", kill_at="file-written").returncode == -signal.SIGKILL
    one_line_error(prep("convert", sources["a"], "-o", out, "--tp", "1", "--resume"), "tp=2", "tp=1", "--resume")
    assert not out.exists()
    r = prep("convert", sources["a"], "-o", out, "--tp", "2", "--resume", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["reused_files"] >= 1
    # Without --resume, leftovers are discarded, and the user is told so.
    assert prep("convert", sources["a"], "-o", out, "--tp", "2", "--force",
                kill_at="file-written").returncode == -signal.SIGKILL
    r = prep("convert", sources["a"], "-o", out, "--tp", "2", "--force")
    assert r.returncode == 0 and "discarded the unfinished run" in r.stderr and no_work_left(out)


# ------------------------------------------------------------------------ 3. one writer at a time
def test_a_second_convert_into_the_same_output_is_refused_at_once_naming_the_holder(sources, tmp_path):
    out = tmp_path / "out"
    work = tmp_path / ".out.prep"
    work.mkdir()
    with open(work / "lock", "w") as f:  # a real flock held by another process (this one)
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("424242\n")
        f.flush()
        t0 = time.monotonic()
        one_line_error(prep("convert", sources["a"], "-o", out), "pid 424242", "another prep process")
        assert time.monotonic() - t0 < 60
    assert not out.exists()
    r = prep("convert", sources["a"], "-o", out)  # the lock released: it runs, and tidies up
    assert r.returncode == 0 and no_work_left(out)


def test_two_converts_started_together_one_wins_and_the_output_verifies(sources, tmp_path):
    out = tmp_path / "out"
    procs = [prep("convert", sources[k], "-o", out, "--tp", "2", wait=False) for k in ("a", "b")]
    results = [finish(p) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes[0] == 0, results
    # The second is refused while the first holds the lock, or, when the first has already
    # finished, because OUT then holds a previous output of prep (it has no --force).
    assert codes == [0, 1] and any(("another prep process" in err or "previous output of prep" in err)
                                   for _, err in results), results
    complete(out)
    assert no_work_left(out)


# ----------------------------------------------------------------------------- 4. revert
def test_revert_reads_one_folder_even_when_another_is_swapped_in_mid_read(sources, tmp_path):
    # A `convert --force` into the folder a `revert --no-verify` reads swaps another output in
    # under it: revert read the rest of the files from the new folder and rebuilt a source mixing
    # both (4 of 16 runs). It now reads every file through the folder it opened (as load_rank
    # does): the rebuild is the first folder's source, byte for byte.
    from conftest import read_tensors
    from prep.revert import revert

    out, other = tmp_path / "out", tmp_path / "other"
    convert(str(sources["a"]), out, target_for(ATOM, tp=2))
    convert(str(sources["b"]), other, target_for(ATOM, tp=2))
    swapped = []

    def swap_once(_n):
        if not swapped:
            swapped.append(1)
            os.rename(out, tmp_path / "aside")
            os.rename(other, out)

    rt = tmp_path / "rt"
    revert(str(out), rt, verify=False, progress=swap_once)
    assert swapped
    want, got = read_tensors(sources["a"]), read_tensors(rt)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k].view(-1).view(torch.uint8), got[k].view(-1).view(torch.uint8)) for k in want)


def test_revert_refuses_a_flipped_byte_and_writes_nothing(workspace):
    out, rt = workspace / "out", workspace / "rt"
    f = sorted(out.glob("model-tp1-rank0-*.safetensors"))[0]
    data = bytearray(f.read_bytes())
    data[-10] ^= 0x40
    f.write_bytes(bytes(data))
    before = snapshot(workspace)
    one_line_error(prep("revert", out, "-o", rt), "does not match its manifest hash", "--no-verify")
    assert snapshot(workspace) == before and not rt.exists() and no_work_left(rt)
    assert prep("revert", out, "-o", rt, "--no-verify").returncode == 0  # asked for: reads it anyway


def test_revert_of_files_that_disagree_with_the_manifest_fails_cleanly(workspace, sources):
    out, rt = workspace / "out", workspace / "rt"
    tp2 = workspace.parent / "tp2"
    assert prep("convert", workspace / "src", "-o", tp2, "--tp", "2").returncode == 0
    # A rank file of another conversion under this one's name: same tensor names, other shapes.
    mine = sorted(out.glob("model-tp1-rank0-*.safetensors"))[0]
    theirs = sorted(tp2.glob("model-tp2-rank0-*.safetensors"))[0]
    shutil.copyfile(theirs, mine)
    before = snapshot(workspace)
    r = prep("revert", out, "-o", rt, "--no-verify")
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert snapshot(workspace) == before and not rt.exists() and no_work_left(rt)


def test_revert_on_a_full_disk_removes_its_partial_output(workspace, monkeypatch):
    import errno

    import prep.directio as dio
    from click.testing import CliRunner

    from prep.cli import main

    real, calls = os.pwrite, []

    def full(fd, buf, offset):
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buf, offset)

    monkeypatch.setattr(dio, "STAGING_BYTES", 64 << 10)
    monkeypatch.setattr(dio.os, "pwrite", full)
    rt = workspace / "rt"
    r = CliRunner().invoke(main, ["revert", str(workspace / "out"), "-o", str(rt)])
    assert r.exit_code == 1 and r.output.startswith("error: ") and "disk full" in r.output, r.output
    assert not rt.exists() and no_work_left(rt) and len(calls) > 2


# ------------------------------------------------------------------------- 8. CLI error shape
def test_json_errors_are_json_and_debug_shows_the_traceback(workspace):
    r = prep("convert", workspace / "src", "-o", workspace / "src", "--json")
    assert r.returncode == 1 and r.stderr == ""
    err = json.loads(r.stdout)
    assert err["ok"] is False and "is the input" in err["error"] and err["code"] == 1
    r = prep("--debug", "convert", workspace / "src", "-o", workspace / "src")
    assert r.returncode == 1 and "Traceback" in r.stderr


def test_a_read_only_output_folder_is_one_line(workspace, tmp_path):
    if os.geteuid() == 0:
        # root ignores permission bits; a read-only bind mount needs privileges tests do not have.
        ro = tmp_path / "ro"
        ro.mkdir()
        r = prep("convert", workspace / "src", "-o", "/proc/prep-out")
        one_line_error(r, "/proc")
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        one_line_error(prep("convert", workspace / "src", "-o", ro / "out"), "cannot write")
    finally:
        ro.chmod(0o755)


# ------------------------------------------------------------------------------ CLI conventions
def test_convert_without_o_writes_beside_the_source_and_says_where(workspace):
    r = prep("convert", "--layout", "preshuffle", "src", cwd=workspace)
    assert r.returncode == 0, r.stderr
    assert f"writing to {workspace / 'src-preshuffle-tp1'}" in r.stderr
    complete(workspace / "src-preshuffle-tp1")
    r = prep("convert", "src", "--moe-layout", "triton", "--tp", "2", "--ep", "1", cwd=workspace)
    assert r.returncode == 0 and (workspace / "src-preshuffle-triton-tp2").is_dir(), r.stderr


def test_python_dash_m_prep_is_the_cli():
    r = subprocess.run([sys.executable, "-m", "prep", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Usage: prep" in r.stdout


def test_ctrl_c_names_the_work_folder_and_resume_continues(workspace, sources):
    out = workspace / "fresh"
    r = prep("convert", workspace / "src", "-o", out, "--tp", "2", interrupt_at="file-written")
    assert r.returncode == 130 and str(workspace / ".fresh.prep") in r.stderr and "--resume" in r.stderr, r.stderr
    r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--json", interrupt_at="file-written")
    err = json.loads(r.stdout)
    assert r.returncode == 130 and err["code"] == 130 and err["interrupted"] is True
    r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--resume", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["reused_files"] >= 1 and no_work_left(out)


@pytest.mark.parametrize("verb, point", [("convert", "old-half-deleted"), ("revert", "old-half-deleted"),
                                         ("convert", "final-state-removed"), ("revert", "final-state-removed")])
def test_ctrl_c_after_the_swap_says_the_new_output_is_in_place(workspace, verb, point):
    # Stopped while the previous output's files are deleted (a 350 GiB one takes a while): the new
    # output is at OUT, complete; the message said "finished files are kept ... --resume" or
    # "nothing was written to DEST" before.
    if verb == "convert":
        out, args = workspace / "out", ["convert", workspace / "src", "-o", workspace / "out", "--tp", "2", "--force"]
        old = complete(out)
    else:
        out, args = workspace / "rt", ["revert", workspace / "out", "-o", workspace / "rt"]
        assert prep(*args).returncode == 0
        args.append("--force")
        old = json.loads((out / "prep-revert.json").read_text())["id"]
    r = prep(*args, interrupt_at=point)  # final-state-removed: the last clean-up step, its state gone already
    assert r.returncode == 130, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("interrupted: ") and "already holds the new output, complete" in line, r.stderr
    assert "--resume" not in line and "nothing was written" not in line
    if verb == "convert":
        assert complete(out) != old
    assert prep(*args).returncode == 0 and no_work_left(out)  # the next run removes the remains


def test_force_into_a_folder_it_cannot_delete_from_is_refused_before_converting(workspace):
    # Before: everything was converted, then the swap failed. Made unwritable with the immutable
    # attribute, which binds root too (the suite runs as root, whom permissions do not stop).
    out = workspace / "out"
    if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        before = snapshot(workspace)
        r = prep("convert", workspace / "src", "-o", out, "--tp", "2", "--force")
        one_line_error(r, "--force must delete the previous output's files there", "not writable")
        assert snapshot(workspace) == before and not (workspace / ".out.prep").exists()
    finally:
        subprocess.run(["chattr", "-i", str(out)], check=True)


def test_a_disk_full_before_the_first_byte_is_one_line_naming_where_and_leaves_nothing(workspace, tmp_path):
    # A filesystem already full (a 256 KiB tmpfs, filled): the lock's pid, the state, the first file
    # cannot be written. Before: "a file: disk full" and an empty lock left in .OUT.prep.
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        before = sorted(p.name for p in disk.iterdir())
        r = prep("convert", workspace / "src", "-o", disk / "out", "--tp", "2")
        one_line_error(r, str(disk), "free space")
        assert "a file" not in r.stderr
        assert sorted(p.name for p in disk.iterdir()) == before  # no .out.prep, no out
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_an_output_its_filesystem_cannot_hold_is_refused_before_a_byte_is_written(workspace, monkeypatch):
    # statvfs's answer stands in for a small disk (the refusal reads it once, before anything is
    # staged); --no-space-check writes anyway.
    from click.testing import CliRunner

    import prep.outdir as od
    from prep.cli import main

    monkeypatch.setattr(od, "free_bytes", lambda path: 1 << 20)
    out = workspace / "small"
    before = snapshot(workspace)
    r = CliRunner().invoke(main, ["convert", str(workspace / "src"), "-o", str(out), "--tp", "2"])
    assert r.exit_code == 1, r.output
    line = r.output.strip()
    assert line.startswith(f"error: -o {out}: the output needs ") and "its filesystem has 0.00 GiB free" in line
    assert "--no-space-check" in line and "\n" not in line
    assert snapshot(workspace) == before and not out.exists() and no_work_left(out)
    r = CliRunner().invoke(main, ["convert", str(workspace / "src"), "-o", str(out), "--tp", "2", "--no-space-check"])
    assert r.exit_code == 0, r.output
    complete(out)


def test_a_fifo_at_the_work_folders_state_does_not_hold_convert(sources, tmp_path):
    # state.json is read as a regular file only: a FIFO there blocked the read forever, with the lock held.
    out = tmp_path / "out"
    work = tmp_path / ".out.prep"
    work.mkdir()
    os.mkfifo(work / "state.json")
    p = prep("convert", sources["a"], "-o", out, "--tp", "2", wait=False)
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("convert hung on a FIFO at .out.prep/state.json")
    assert p.returncode == 0, err
    assert prep("verify", out).returncode == 0


@pytest.mark.skipif(not os.path.ismount("/proc"), reason="needs /proc mounted (Linux)")
def test_a_mount_point_as_out_is_refused_before_any_work(sources):
    # OUT is built beside itself and swapped in: a mount point cannot be (it staged the whole output on the
    # parent filesystem, then failed the swap with EBUSY, keeping nothing).
    for verb in (("convert", sources["a"], "-o", "/proc", "--force"),):
        one_line_error(prep(*verb), "-o /proc: is a mount point", "-o /proc/OUT")
    assert not os.path.lexists("/.proc.prep")
