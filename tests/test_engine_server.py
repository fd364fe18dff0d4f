"""The suite's engine checks run as forks of one server per engine (harness/forkserver.py,
tests/engine_server.py): a check forked from it must end as the same command run as a process of
its own does, its exit status and its words included."""

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
