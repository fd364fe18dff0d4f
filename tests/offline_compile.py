"""Compile one of our Triton kernels for NVIDIA sm_90 and AMD gfx942 without a GPU, in a child
process: the suite imported the kernels interpreted (``TRITON_INTERPRET=1``), and a compile needs
them jitted. Each kernel module's ``compile_offline(target, m, n1, n2, has_res, **kw)`` builds the
launch's arguments (``layouts._triton_offline``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

_CHILD = """
import json, sys, importlib
import torch
from triton.backends.compiler import GPUTarget
mod = importlib.import_module(sys.argv[1])
shape = json.loads(sys.argv[2])
results = []
for common in json.loads(sys.argv[4]):
    out = {}
    for name, target, kw in (("nvidia", GPUTarget("cuda", 90, 32), {}),
                             ("amd", GPUTarget("hip", "gfx942", 64), json.loads(sys.argv[3]))):
        kw = dict(common, **kw)
        kw = {k: getattr(torch, v[len("torch."):]) if isinstance(v, str) and v.startswith("torch.") else v
              for k, v in kw.items()}
        ck = mod.compile_offline(target, *shape, **kw)
        out[name] = {k: (v if isinstance(v, str) else len(v)) for k, v in ck.asm.items()}
    results.append(out)
print(json.dumps(results))
"""


def compile_for_nvidia_and_amd(module: str, shape: tuple, cache_dir: Path, amd_kwargs: dict | None = None,
                               kwargs: dict | list[dict] | None = None) -> dict | list[dict]:
    """``{"nvidia": asm, "amd": asm}`` of ``module.compile_offline(target, *shape, **kwargs)`` (text asm as
    text, binaries by their length); for a list of ``kwargs``, one such dict each, compiled in the
    same child (one fork of the suite's ``python`` server for all). Fails on a compile error, and on any
    error LLVM prints (Triton 3.9's AMD back end reports inline asm it cannot place and compiles on
    without it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; fused, as launches are
    env["TRITON_CACHE_DIR"] = str(cache_dir)  # compiled here, not found in a cache (LLVM's errors print once)
    variants = kwargs if isinstance(kwargs, list) else [kwargs or {}]
    args = [module, json.dumps(list(shape)), json.dumps(amd_kwargs or {}), json.dumps(variants)]
    # Forked from the run's `python` server (torch imported once a run, triton not: it reads
    # TRITON_CACHE_DIR and TRITON_INTERPRET at import), where the suite has one.
    child = cache_dir / "offline_compile_child.py"
    child.write_text(_CHILD)
    from conftest import forked_python

    rc, stdout, stderr = forked_python(None, args, env, timeout=300, path=child)
    assert rc == 0 and "error" not in stderr.lower(), stderr[-2000:]
    results = json.loads(stdout.strip().splitlines()[-1])
    return results if isinstance(kwargs, list) else results[0]
