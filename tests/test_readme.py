"""README.md runs as written: every code block is executed verbatim on the CPU.

The blocks run, in README order, in one work folder that looks like a set-up clone:
``.venv/bin/prep`` and ``.venv/bin/python`` run this interpreter (on this checkout), ``scripts/``
is the repository's, and ``amd/DeepSeek-R1-0528-MXFP4`` resolves offline (``HF_HUB_CACHE``,
``HF_HUB_OFFLINE=1``) to a tiny generated r1-0528 checkpoint, which converts at ``--tp 8``.
bash blocks run with ``set -euo pipefail``; python blocks run as scripts. A block that must not
run carries ``<!-- readme-test: skip (why) -->`` on the line before it; the sample output block
(``<!-- readme-test: sample ... -->``) has its ``$`` lines run, and their output must keep the
sample's lines: the same, number for number, but for durations and peak memory (file names never
appear in it).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

from hub_cache import fake_hub_cache

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
REPO_ID = "amd/DeepSeek-R1-0528-MXFP4"
MARKER = re.compile(r"<!--\s*readme-test:\s*(\w+)\s*(?:\((.*)\))?\s*-->")


@dataclasses.dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    marker: str | None = None  # "skip" or "sample", from the comment just before the fence
    why: str | None = None


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text``, with the readme-test marker of the line before it."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        m = MARKER.search(prev)
        blocks.append(Block(fence.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1,
                            m.group(1) if m else None, m.group(2) if m else None))
        i = end + 1
    return blocks


def _shape(text: str) -> list[str]:
    """The lines with what varies from run to run masked: durations and peak memory. Every other
    number (tensors, files, bytes, logits) is what the sample promises of the real output."""
    out = []
    for line in text.strip().splitlines():
        line = re.sub(r"\b\d+(\.\d+)? s\b", "# s", line.rstrip())
        out.append(re.sub(r"peak memory \d+(\.\d+)? GiB", "peak memory # GiB", line))
    return out


def _wrapper(path: pathlib.Path, *argv: str) -> None:
    # A script, not a symlink: a symlinked interpreter would not find the virtual environment
    # it belongs to, and `prep` must run this checkout's code whatever is installed.
    path.write_text("#!/bin/sh\nexec " + " ".join(f"'{a}'" for a in argv) + ' "$@"\n')
    path.chmod(0o755)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("clone")
    (work / ".venv" / "bin").mkdir(parents=True)
    _wrapper(work / ".venv" / "bin" / "python", sys.executable)
    _wrapper(work / ".venv" / "bin" / "prep", sys.executable, "-m", "prep")
    (work / "scripts").symlink_to(ROOT / "scripts")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PREP_", "ATOM_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(work.parent / f"{work.name}-hub" / "hub"),
               CUDA_VISIBLE_DEVICES="")
    return work, env


def _sh(cmd: str, work: pathlib.Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)


def test_only_the_set_up_commands_are_skipped():
    blocks = readme_blocks(README.read_text())
    skipped = [b for b in blocks if b.marker == "skip"]
    assert [b.code for b in skipped] == [b.code for b in blocks if "scripts/demo.sh" in b.code]
    assert len(skipped) == 1 and "scripts/test.sh" in skipped[0].code and "set-up" in skipped[0].why
    assert {b.marker for b in blocks} <= {None, "skip", "sample", "atom", "sglang", "vllm"}, "unknown readme-test marker"
    # "atom" / "sglang": what serving with that engine looks like, which needs it on an AMD GPU (the
    # doors' own tests run its loading on the CPU, tests/test_atom_serve.py, test_sglang_door.py);
    # such a block shows the door and nothing else.
    assert all("prep-atom-serve" in b.code for b in blocks if b.marker == "atom")
    assert all("sglang.launch_server" in b.code for b in blocks if b.marker == "sglang")
    assert all("vllm serve" in b.code for b in blocks if b.marker == "vllm")
    assert [b.lang for b in blocks if b.marker is None] and all(
        b.lang in ("bash", "python") for b in blocks if b.marker is None), "a block the test cannot run"
    assert sum(b.marker == "sample" for b in blocks) == 1


def test_readme_does_not_point_outside_the_repository():
    text = README.read_text()
    assert "../" not in text
    for target in re.findall(r"\]\(([^)#]+)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links {target}, which is not in the repository"
    for doc in re.findall(r"`(docs/[\w./-]+\.md)`", text):
        assert (ROOT / doc).exists(), f"README names {doc}, which is not in the repository"


def test_every_readme_block_runs_verbatim(work):
    work, env = work
    blocks = readme_blocks(README.read_text())
    sample = next(b for b in blocks if b.marker == "sample")
    # The sample runs first: its first command generates the checkpoint the hub cache serves.
    ran = []
    for step in re.split(r"\n(?=\$ )", "\n" + sample.code.strip())[1:]:
        cmd, _, want = step[2:].partition("\n")
        r = _sh(cmd, work, env)
        assert r.returncode == 0, f"README line {sample.line}: `{cmd}` failed:\n{r.stdout}{r.stderr}"
        assert _shape(r.stdout + r.stderr) == _shape(want), (
            f"README sample (line {sample.line}): `{cmd}` now prints\n{r.stdout}{r.stderr}\ninstead of\n{want}")
        ran.append(cmd)
    generate = ran[0].split()
    assert generate[1] == "scripts/make_tiny_deepseek.py", "the sample must start by generating its checkpoint"
    src = work / generate[2]
    fake_hub_cache(pathlib.Path(env["HF_HUB_CACHE"]).parent, src, repo=REPO_ID)
    for b in blocks:
        if b.marker is not None:
            continue
        if b.lang == "bash":
            r = _sh(b.code, work, env)
        else:
            r = subprocess.run([sys.executable, "-c", b.code], cwd=work, env=env, capture_output=True, text=True,
                               timeout=300)
        assert r.returncode == 0, f"README block at line {b.line} ({b.lang}) failed:\n{b.code}\n{r.stdout}{r.stderr}"
        ran.append(b.code)
    assert any(REPO_ID in c and "--tp 8" in c for c in ran)  # the real checkpoint's commands ran, by repo id
    assert (work / "r1-tp8" / "prep-complete.json").exists() and (work / "r1-roundtrip").is_dir()
    assert (work / "logits.safetensors").exists()


def test_a_failing_block_fails_the_test(work):
    # The runner itself: a block that exits non-zero, or a sample that no longer matches, is caught.
    work, env = work
    assert _sh("true\nfalse\ntrue", work, env).returncode != 0
    assert _sh("false | cat", work, env).returncode != 0
    # Counts are checked (a stale "217 tensors" once passed, every digit masked); times and peaks not.
    assert _shape("wrote x: 217 tensors, 0.029 GiB") != _shape("wrote x: 593 tensors, 0.029 GiB")
    assert _shape("tiny: 257 tensors, 9 files, 5.8 s") == _shape("tiny: 257 tensors, 9 files, 0.4 s")
    assert _shape("peak memory 0.42 GiB (--max-memory 8)") == _shape("peak memory 0.39 GiB (--max-memory 8)")
    assert _shape("peak memory 0.42 GiB (--max-memory 8)") != _shape("peak memory 0.42 GiB (--max-memory 4)")
    assert _shape("ok: 9 files") != _shape("ok: 9 files, 3 reused")


def test_blocks_are_found_with_their_markers():
    text = "a\n<!-- readme-test: skip (why not) -->\n```bash\necho 1\n```\n\n```python\nx = 1\n```\n"
    one, two = readme_blocks(text)
    assert (one.lang, one.code, one.marker, one.why, one.line) == ("bash", "echo 1\n", "skip", "why not", 3)
    assert (two.lang, two.marker) == ("python", None)


def test_the_manifest_format_the_readme_names_is_the_one_written():
    from layouts.manifest import FORMAT_VERSION

    said = re.findall(r"That is manifest format (\d+)", README.read_text())
    assert said == [str(FORMAT_VERSION)], f"README says manifest format {said}; prep writes {FORMAT_VERSION}"


def test_the_test_counts_the_docs_give_are_this_suites_within_five_percent():
    # The README and docs/testing.md quote how many tests ran: a count that drifted more than 5% from
    # what pytest collects now (tests added or removed since) must be measured again.
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", str(ROOT / "tests")],
                       capture_output=True, text=True, cwd=ROOT)
    collected = int(re.search(r"(\d+) tests? collected", r.stdout).group(1))
    counts = [int(n) for n in re.findall(r"\b(\d{3,5})\s+tests\b", README.read_text())]
    testing = (ROOT / "docs" / "testing.md").read_text()
    counts += [int(a) + int(b) for a, b in re.findall(r"\b(\d{3,5})\s+passed,\s+(\d+)\s+skipped", testing)]
    assert counts, "no test count found in README.md or docs/testing.md"
    for n in counts:
        assert abs(n - collected) <= collected // 20, f"a doc says {n} tests; pytest collects {collected} now"
