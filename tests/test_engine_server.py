"""The suite's engine checks run as forks of one server per engine (harness/forkserver.py,
tests/engine_server.py): a check forked from it must end as the same command run as a process of
its own does, its exit status and its words included."""

import pytest
from conftest import engine_check


def test_a_failing_check_forked_from_the_engine_server_fails_as_the_command_does(tmp_path):
    # A converted folder that is not one: the check stops at its first look, before the engine's own
    # imports, so the process of its own costs ~2 s here.
    (tmp_path / "src").mkdir()
    (tmp_path / "out").mkdir()
    args = ("vllm", tmp_path / "src", tmp_path / "out", tmp_path / "work")
    forked = engine_check(*args)
    alone = engine_check(*args, forked=False)
    assert forked[0] == alone[0] == 1
    last = [r[2].strip().splitlines()[-1] for r in (forked, alone)]
    assert last[0] == last[1] and str(tmp_path / "out") in last[0], (forked, alone)
    assert forked[1] == alone[1]


def test_a_forked_run_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    # ATOM's start-ups run forked from prep's environment's server with a timeout, as a new
    # interpreter did: past it the run and every process it started are killed, exit status None.
    import os
    import time

    from conftest import forked_python

    pidfile = tmp_path / "child.pid"
    code = (f"import os, subprocess, time; p = subprocess.Popen(['sleep', '60']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.monotonic()
    rc, _, _ = forked_python("timeit", ["-n", "1", "-r", "1", code], dict(os.environ), timeout=3)
    assert rc is None and time.monotonic() - t0 < 30
    child = int(pidfile.read_text())
    for _ in range(100):  # the grandchild ends with the run's session (SIGKILL to the group)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"process {child}, started by the killed run, is still alive")
    rc, out, _ = forked_python("timeit", ["-n", "1", "-r", "1", "pass"], dict(os.environ))
    assert rc == 0 and "loop" in out


def test_check_engine_on_a_folder_prep_did_not_write_is_one_line_before_any_engine_starts(tmp_path):
    from harness.__main__ import main

    (tmp_path / "model.safetensors").write_bytes(b"not a conversion")
    for engine in ("atom", "sglang", "vllm"):
        with pytest.raises(SystemExit) as exc:
            main(["check-engine", engine, "--source", str(tmp_path), "--converted", str(tmp_path)])
        assert str(exc.value) == f"error: --converted {tmp_path}: no prep-manifest.json; not a checkpoint converted by prep"
