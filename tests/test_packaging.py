"""The two distributions this repository builds, installed as a user and an engine would:

* ``mxfp4-layouts`` (runtime/): the runtime library alone, into a fresh virtual environment that
  holds torch and numpy and nothing else of prep's: ``layouts`` imports, checks and loads a
  converted checkpoint there, click/tqdm/huggingface_hub/xxhash are absent, and a hash check says
  which extra to install;
* ``prep``: the command line with the library, into a fresh environment; ``prep`` is on its
  PATH and runs. (Install one of the two: both hold ``layouts``.)

The wheels are built from this checkout; the fresh environments get their third-party packages
by linking the installed ones (torch is 700 MB: no download), so pip sees exactly the packages
named and must resolve prep's own from the wheels."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from prep.convert import convert
from prep.deepseek import target_for
from prep.testing import SynthSpec
from checkpoints import write_checkpoint
from layouts.engines import get_engine

ATOM = get_engine("atom")  # the engine whose profile these tests use

REPO = pathlib.Path(__file__).resolve().parent.parent
OURS = {"mxfp4-prep", "mxfp4-layouts"}
PREP_ONLY = ("click", "tqdm", "huggingface_hub", "xxhash")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: list[str]) -> dict[str, md.Distribution]:
    """The installed distributions ``names`` need, with what they need (extras left out)."""
    todo, seen = list(names), {}
    while todo:
        name = _norm(todo.pop())
        if name in seen or name in OURS:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:  # required only under a marker this Python does not meet
            continue
        seen[name] = dist
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            todo.append(re.split(r"[ ;<>=!~\[(]", req, 1)[0])
    return seen


def _clean_env() -> dict[str, str]:
    """This environment less what points into the checkout: with PYTHONPATH on the worktree (as
    helpers run the tests), pip would find its prep.egg-info and install nothing."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}


def _fresh_venv(path: pathlib.Path, packages: list[str]) -> pathlib.Path:
    """A new virtual environment holding ``packages`` and what they need, linked from this one."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, capture_output=True)
    py = path / "bin" / "python"
    site = pathlib.Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       check=True, capture_output=True, text=True).stdout.strip())
    ours = pathlib.Path(sysconfig.get_paths()["purelib"])
    for dist in _closure(packages).values():
        tops = {pathlib.Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = ours / top
            if src.exists() and not (site / top).exists() and not top.endswith(".pth"):
                (site / top).symlink_to(src)
    return py


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    # Built from a copy: a build writes egg-info and build/ folders into the project, which must
    # not land in the checkout (nor race another test reading it).
    tree = tmp_path_factory.mktemp("tree")
    for item in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / item, tree / item)
    for item in ("prep", "layouts", "runtime", "harness"):  # harness: beside them, and in neither wheel
        shutil.copytree(REPO / item, tree / item, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheels")
    for project in (tree / "runtime", tree):
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(project)], capture_output=True, text=True, cwd=out)
        assert r.returncode == 0, r.stderr
    return out


def _meta(wheel: pathlib.Path) -> tuple[list[str], str]:
    with zipfile.ZipFile(wheel) as z:
        info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        points = next((n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")), None)
        meta = z.read(info).decode()
        files = z.namelist()
        return ([x.split(":", 1)[1].strip() for x in meta.splitlines() if x.startswith("Requires-Dist:")],
                (z.read(points).decode() if points else "") + "\n".join(files))


def test_the_runtime_wheel_needs_torch_alone_and_the_cli_wheel_the_rest(wheels):
    runtime, = wheels.glob("mxfp4_layouts-*.whl")
    cli, = wheels.glob("mxfp4_prep-*.whl")
    requires, listing = _meta(runtime)
    assert sorted(r for r in requires if "extra ==" not in r) == ["numpy", "torch>=2.7"]
    assert [r for r in requires if "extra ==" in r] == ['xxhash>=3.0; extra == "hashes"']
    assert "layouts/loader.py" in listing and "prep/cli/app.py" not in listing
    assert "harness/" not in listing  # the engine checks are test support, in neither distribution
    requires, listing = _meta(cli)
    assert {"click>=8.1", "tqdm>=4.60", "huggingface_hub>=0.34", "xxhash>=3.0"} <= set(requires)
    assert "prep = prep.cli:run" in listing and "prep/cli/app.py" in listing and "layouts/loader.py" in listing
    assert "harness/" not in listing


def test_an_engine_environment_loads_a_checkpoint_with_the_runtime_alone(wheels, tmp_path):
    src = write_checkpoint(SynthSpec(variant="v2"), tmp_path / "src")
    out = tmp_path / "tp2"
    convert(str(src), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2))
    py = _fresh_venv(tmp_path / "engine", ["torch", "numpy"])
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--find-links", str(wheels), "-q",
                        "--disable-pip-version-check", "mxfp4-layouts"], capture_output=True, text=True, cwd=tmp_path,
                       env=_clean_env())
    assert r.returncode == 0, r.stderr
    code = f"""
import importlib.util, json, sys
import layouts
absent = [m for m in {PREP_ONLY!r} if importlib.util.find_spec(m) is not None]
engine = layouts.EngineConfig.from_env(layouts.get_engine("atom"), tp_size=2, rank=1, env={{}})
t = layouts.load_rank({str(out)!r}, 1, "cpu", engine=engine)
w13 = t["model.layers.1.mlp.experts.w13_weight"]
try:
    layouts.load_rank({str(out)!r}, 1, "cpu", verify_hashes=True)
    hashes = "checked"
except layouts.LayoutsError as e:
    hashes = str(e)
print(json.dumps({{"file": layouts.__file__, "present": absent, "shuffled": w13.is_shuffled,
                  "shape": list(w13.shape), "hashes": hashes}}))
"""
    env = _clean_env()
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["file"].startswith(str(tmp_path / "engine")) and got["present"] == []
    assert got["shuffled"] is True and len(got["shape"]) == 3
    assert "needs xxhash" in got["hashes"] and "mxfp4-layouts[hashes]" in got["hashes"]


def test_pip_install_prep_gives_the_cli(wheels, tmp_path):
    py = _fresh_venv(tmp_path / "user", ["torch", "numpy", "safetensors", "click", "tqdm", "huggingface_hub",
                                         "xxhash"])
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--find-links", str(wheels), "-q",
                        "--disable-pip-version-check", "mxfp4-prep"], capture_output=True, text=True, cwd=tmp_path,
                       env=_clean_env())
    assert r.returncode == 0, r.stderr
    env = _clean_env()
    r = subprocess.run([str(py.parent / "prep"), "--version"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "prep, version 0.1.0" in r.stdout, r.stderr
    r = subprocess.run([str(py.parent / "prep"), "inspect", str(tmp_path / "nope"), "--json"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 1 and json.loads(r.stdout)["code"] == 1
