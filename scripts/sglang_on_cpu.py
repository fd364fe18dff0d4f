"""SGLang 0.5.23's real DeepSeek model and loaders, built and loaded on a CPU without ROCm (for
scripts/check_engine_install.py --engine sglang; run with .venv-sglang's Python:
``bash scripts/setup_env.sh --sglang``). Built like scripts/atom_on_cpu.py.

What is real: all of ``sglang`` (model classes, ``DefaultModelLoader``, ``ShardedStateLoader``,
Quark config/scheme code, FusedMoE, weight loaders, ``process_weights_after_loading``), torch,
transformers, safetensors, triton (its Python package; nothing is compiled or launched here), and
aiter's pure-Python files loaded from an aiter source tree (``AITER_DIR``): ``aiter/ops/shuffle.py``
(``shuffle_weight``, ``shuffle_scale``), ``aiter/utility/fp4_utils.py`` (``e8m0_shuffle``),
``dtypes``, ``mx_types``, ``aiter_types``.

What is a stand-in (each call recorded in :data:`CALLS`):

* every other ``aiter`` module (``import aiter`` needs ROCm); ``aiter.ops.enum`` gets Python
  enums with aiter's names/values, ``aiter.jit.utils.chip_info`` answers gfx950;
* GPU-only binary packages SGLang imports at module level and that are not installed here
  (sgl_kernel, flashinfer, cuda-python, deep_gemm, ...): permissive stand-in modules;
* the platform: ``torch.version.hip`` is set and ``torch.cuda`` answers as one MI355 (gfx950)
  so SGLang picks its ROCm + ``SGLANG_USE_AITER=1`` paths; ``device="cuda"`` is mapped to the
  CPU by a TorchFunctionMode, which also fills every ``torch.empty*`` with one byte (so memory
  that loading never writes is visible);
* the process groups: one process plays TP rank r of size N through SGLang's own
  ``publish(server_args, ranks=SpawnRanks(world_rank=r))`` and ``get_parallel().override_permanently``
  with fake group objects (rank_in_group/world_size; any collective is recorded).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
WORK = {"dir": REPO / ".cache" / "sglang-check"}  # config copies (config_copy)
# aiter's source tree (the oracles' aiter-*.tar.gz, extracted by the caller: install(aiter_dir))
AITER = {"dir": pathlib.Path(os.environ.get("PREP_AITER_SRC", REPO / ".cache" / "aiter-src"))}
GPU_ARCH = {"name": "gfx950"}

# The amd-aiter wheel's files (scripts/fetch_aiter_oracle.py; $PREP_AITER_DIR as prep.reference.aiter_gemm reads it)
AITER_ORACLE_DIR = pathlib.Path(os.environ.get("PREP_AITER_DIR", REPO / ".cache" / "aiter-oracle"))
# aiter's Triton MXFP4 quantizer (SGLang's post_load_weights quantizes the MLA w_kc/w_vc with it):
# run by triton's CPU interpreter, which must be chosen before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SGLANG_USE_AITER", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # scripts/, for the shared stand-ins
import stand_ins  # noqa: E402
import mi355x  # noqa: E402
from mi355x import on_cpu  # noqa: E402
from stand_ins import called_from  # noqa: E402
from stand_ins import StandIn, StandInModule, fill_aiter_stub  # noqa: E402

CALLS = stand_ins.CALLS  # every call of a stand-in, by name, in order (stand_ins)

REAL_AITER = stand_ins.REAL_AITER
# ... and from the amd-aiter wheel's files (prep's .cache/aiter-oracle): its Triton quantizer.
REAL_AITER_ORACLE = ("aiter.ops.triton.quant", "aiter.ops.triton._triton_kernels.quant", "aiter.ops.triton.utils.logger")
# Top-level packages that get a stand-in when not importable here (GPU-only binaries).
STANDIN_PACKAGES = {"aiter", "sgl_kernel", "flashinfer", "cuda", "deep_gemm", "deep_ep", "flash_mla", "quack",
                    "cutlass", "tilelang", "humming", "torch_memory_saver", "mooncake", "flash_attn", "triton_kernels",
                    "mori", "pynvml", "amdsmi", "vllm", "nvshmem", "tvm_ffi", "torchvision"}
# Stand-ins transformers must not see (it would parse their missing version): it asks find_spec.
HIDDEN_FROM_TRANSFORMERS = {"torchvision"}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, aiter_root: pathlib.Path):
        self.root = aiter_root
        self.absent = {p for p in STANDIN_PACKAGES if p == "aiter" or importlib.util.find_spec(p) is None}
        self.made: set[str] = set()

    def find_spec(self, name, path, target=None):
        top = name.partition(".")[0]
        if top not in self.absent:
            return None
        if top in HIDDEN_FROM_TRANSFORMERS and called_from("transformers.utils.import_utils"):
            return None
        if name == "aiter.utility.aiter_types" and not (self.root / "csrc/include/aiter_enum.h").is_file():
            return importlib.machinery.ModuleSpec(name, self)
        if name in REAL_AITER:
            return importlib.util.spec_from_file_location(name, self.root / (name.replace(".", "/") + ".py"))
        if name in REAL_AITER_ORACLE:
            return importlib.util.spec_from_file_location(name, AITER_ORACLE_DIR / (name.replace(".", "/") + ".py"))
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = StandInModule(spec.name)
        m.__path__ = []
        self.made.add(spec.name)
        return m

    def exec_module(self, m):
        fill_aiter_stub(m, lambda: GPU_ARCH["name"])


# ---------------------------------------------------------------- the platform: one MI355 (gfx950), scripts/mi355x.py

_INSTALLED = {"done": False}


def install(aiter_dir: str | os.PathLike | None = None) -> None:
    """Stand-ins and platform patches; then import SGLang's DeepSeek model and loader. ``aiter_dir``:
    an aiter source tree (default ``$PREP_AITER_SRC``, else ``.cache/aiter-src``)."""
    if _INSTALLED["done"]:
        return
    if aiter_dir is not None:
        AITER["dir"] = pathlib.Path(aiter_dir)
    AITER_DIR = AITER["dir"]
    if not (AITER_DIR / "aiter" / "ops" / "shuffle.py").is_file():
        raise SystemExit(f"{AITER_DIR}: no aiter/ops/shuffle.py; pass an aiter source tree (the oracles' "
                         "aiter-*.tar.gz, extracted)")
    if not (AITER_ORACLE_DIR / "aiter" / "ops" / "triton" / "quant.py").is_file():
        raise SystemExit(f"{AITER_ORACLE_DIR}: no aiter/ops/triton/quant.py; run python scripts/fetch_aiter_oracle.py")
    mi355x.patch_torch()
    from triton.runtime import driver as triton_driver  # the DriverConfig object

    triton_driver.set_active(mi355x.TritonHipDriver())
    sys.meta_path.insert(0, _Finder(AITER_DIR))
    import sglang.srt.utils.common as common

    common.get_amdgpu_memory_capacity = lambda: 288 * 1024.0  # MiB, one MI355X (it runs rocminfo)
    _INSTALLED["done"] = True


# ---------------------------------------------------------------- process groups: one process, any rank

class FakeGroup:
    """A GroupCoordinator for one process playing ``rank_in_group`` of ``world_size``: sizes and
    ranks are answered; every collective or other method is a recorded stand-in."""

    def __init__(self, name: str, rank: int, size: int):
        self.name, self.rank_in_group, self.world_size = name, rank, size
        self.rank = self.local_rank = rank
        self.ranks = list(range(size))
        self.first_rank, self.last_rank = 0, size - 1
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1
        self.device = torch.device("cpu")
        self.cpu_group = self.device_group = None
        self.use_pynccl = self.use_custom_allreduce = False

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn(f"group[{self.__dict__.get('name')}].{name}")

    def __repr__(self):
        return f"<FakeGroup {self.name} {self.rank_in_group}/{self.world_size}>"


def config_copy(src: str | os.PathLike, dst: str | os.PathLike | None = None) -> tuple[pathlib.Path, list]:
    """:func:`stand_ins.config_copy` into this harness's work folder by default."""
    return stand_ins.config_copy(src, dst or WORK["dir"] / (pathlib.Path(src).name + "-re-excludes"))


def sglang_excluded(src, names: list[str]) -> dict[str, bool]:
    """What SGLang's own should_ignore_layer says for module NAMES under SRC's exclude list."""
    install()
    from sglang.srt.layers.quantization.quark.utils import should_ignore_layer

    cfg = json.loads((pathlib.Path(src) / "config.json").read_text())
    excl = cfg["quantization_config"]["exclude"]
    fused = {"fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"], "gate_up_proj": ["gate_proj", "up_proj"]}
    return {n: should_ignore_layer(n, ignore=excl, fused_mapping=fused) for n in names}


_PUBLISHED = {}


def setup(model_path: str, tp: int, rank: int, ep: int = 1, load_format: str = "auto", **server_kw):
    """Publish a ServerArgs for TP rank RANK of TP, as SGLang's scheduler process does, with
    fake groups; return (model_config, load_config, device_config)."""
    install()
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    kw = dict(model_path=str(model_path), tp_size=tp, ep_size=ep, device="cuda", load_format=load_format,
              skip_tokenizer_init=True, trust_remote_code=False, quantization=None, dtype="bfloat16",
              disable_cuda_graph=True)
    kw.update(server_kw)
    sa = ServerArgs(**kw)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=0))
    par = get_parallel()
    groups = {}
    for g in ("tp", "attn_tp", "moe_tp", "moe_ep", "moe_dp", "pp", "attn_cp", "attn_dp", "shared_experts_tp",
              "dcp", "attn_dcp", "world"):
        try:
            r, n = getattr(par, f"{g}_rank"), getattr(par, f"{g}_size")
        except Exception:
            continue
        groups[f"{g}_group"] = FakeGroup(g, r, n)
    ok = {}
    for k, v in groups.items():
        try:
            par.override_permanently(**{k: v})
            ok[k] = v
        except ValueError:
            pass
    _PUBLISHED.update(sa=sa, groups=ok)
    model_config = ModelConfig.from_server_args(sa)
    load_config = LoadConfig(load_format=load_format, tp_rank=rank, model_loader_extra_config=sa.model_loader_extra_config)
    device_config = DeviceConfig("cuda", 0)
    return model_config, load_config, device_config


# ---------------------------------------------------------------- loading

EXTRAS: dict = {}  # the last load's tensors held outside state_dict (e.g. MLA w_kc/w_vc), by name


def _state_dict(model) -> dict:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    EXTRAS.clear()
    ptrs = {id(v) for v in model.state_dict(keep_vars=True).values()}
    for mname, mod in model.named_modules():
        for a, v in vars(mod).items():
            if isinstance(v, torch.Tensor) and not a.startswith("_") and id(v) not in ptrs:
                EXTRAS[f"{mname}.{a}"] = v.detach().clone()
    return sd


def build_and_load(model_path, tp: int, rank: int, load_format: str = "auto", ep: int = 1, fill: int = 0xA5,
                   **server_kw):
    """SGLang's own loader for LOAD_FORMAT (get_model_loader(...).load_model) on rank RANK of TP."""
    mc, lc, dc = setup(model_path, tp, rank, ep=ep, load_format=load_format, **server_kw)
    from sglang.srt.model_loader import get_model_loader

    loader = get_model_loader(lc, mc)
    with on_cpu(fill):
        model = loader.load_model(model_config=mc, device_config=dc)
    return model, loader


def default_load(src, tp: int, rank: int, ep: int = 1, fill: int = 0xA5, **kw) -> dict:
    """DefaultModelLoader: load_weights (whose DeepSeek loader ends with post_load_weights), then
    every quant method's process_weights_after_loading. Returns model.state_dict() (clones).
    ``kw``: ServerArgs fields (a config whose Quark excludes SGLang cannot match needs
    ``json_model_override_args``, or a :func:`config_copy`)."""
    model, loader = build_and_load(src, tp, rank, "auto", ep=ep, fill=fill, **kw)
    assert type(loader).__name__ == "DefaultModelLoader", type(loader)
    return _state_dict(model)


def sharded_state_load(folder, tp: int, rank: int, ep: int = 1, fill: int = 0xA5, **kw) -> dict:
    """ShardedStateLoader.load_model on FOLDER (config.json + model-rank-{r}-part-{n}.safetensors)."""
    model, loader = build_and_load(folder, tp, rank, "sharded_state", ep=ep, fill=fill, **kw)
    assert type(loader).__name__ == "ShardedStateLoader", type(loader)
    return _state_dict(model)


def save_sharded_state(src, tp: int, out, ep: int = 1, max_size: int | None = None, **kw) -> pathlib.Path:
    """Default-load every rank and write it with SGLang's ShardedStateLoader.save_model; copies
    config.json (the re:-rewritten one) and the other non-weight files so OUT is a model folder."""
    from_folder, _ = config_copy(src)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in pathlib.Path(from_folder).iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copyfile(f.resolve(), out / f.name)
    for r in range(tp):
        model, _ = build_and_load(from_folder, tp, r, "auto", ep=ep, **kw)
        from sglang.srt.model_loader.loader import ShardedStateLoader

        ShardedStateLoader.save_model(model, str(out), max_size=max_size)
        del model
    return out


# ---------------------------------------------------------------- reports

def is_mxfp4(name: str, t: torch.Tensor) -> str | None:
    """'weight' / 'scale' for uint8 MXFP4 packed weights / E8M0 scales, else None."""
    if t.dtype != torch.uint8:
        return None
    return "scale" if name.endswith("_scale") or name.endswith("weight_scale") else "weight"


def unset_bytes(src, tp: int, rank: int, loader: str = "default", **kw) -> dict[str, int]:
    """Keys whose bytes depend on what torch.empty* held (two loads, fill 0xA5 and 0x5A): the
    count of differing bytes per key; an empty dict means loading wrote every byte."""
    f = default_load if loader == "default" else sharded_state_load
    a, b = f(src, tp, rank, fill=0xA5, **kw), f(src, tp, rank, fill=0x5A, **kw)
    out = {}
    for k in a:
        x, y = a[k].contiguous().view(-1).view(torch.uint8), b[k].contiguous().view(-1).view(torch.uint8)
        n = int((x != y).sum())
        if n:
            out[k] = n
    return out


def describe(sd: dict, unset: dict | None = None) -> list[dict]:
    rows = []
    for k, v in sd.items():
        rows.append({"key": k, "dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape),
                     "mxfp4": is_mxfp4(k, v), "unset_bytes": (unset or {}).get(k, 0), "bytes": v.numel() * v.element_size()})
    return rows


def same(a: dict, b: dict) -> list[str]:
    """Keys that differ (names, dtype, shape or bytes) between two state dicts; [] = byte-identical."""
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)):
            bad.append(k)
    return bad


def stand_in_calls() -> dict[str, int]:
    out: dict[str, int] = {}
    for c in CALLS:
        out[c] = out.get(c, 0) + 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("default-load", "sharded-state-load"):
        p = sub.add_parser(name)
        p.add_argument("src")
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--rank", type=int, default=0)
        p.add_argument("--ep", type=int, default=1)
        p.add_argument("--unset", action="store_true", help="load twice (fill bytes 0xA5/0x5A) to find unset bytes")
        p.add_argument("--out", help="JSON report")
    p = sub.add_parser("save-sharded-state")
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p = sub.add_parser("roundtrip", help="save-sharded-state, then sharded-state-load each rank == default-load")
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p = sub.add_parser("excludes", help="what SGLang's should_ignore_layer says for SRC's exclude list")
    p.add_argument("src")
    for p in sub.choices.values():
        if p.prog.split()[-1] != "excludes":
            p.add_argument("--enforce-shared-experts-fusion", action="store_true",
                           help="SGLang's --enforce-shared-experts-fusion (the tiny configs' 8 experts are not on its "
                                "fusion allow-list, 256/384)")
    a = ap.parse_args(argv)
    kw = {"enforce_shared_experts_fusion": True} if getattr(a, "enforce_shared_experts_fusion", False) else {}
    t0 = time.time()
    if a.cmd in ("default-load", "sharded-state-load"):
        f = default_load if a.cmd == "default-load" else sharded_state_load
        sd = f(a.src, a.tp, a.rank, ep=a.ep, **kw)
        t1 = time.time()
        unset = unset_bytes(a.src, a.tp, a.rank, "default" if a.cmd == "default-load" else "sharded", ep=a.ep, **kw) \
            if a.unset else None
        rows = describe(sd, unset)
        for r in rows:
            print(f"{r['key']:70s} {r['dtype']:9s} {str(r['shape']):18s} {r['mxfp4'] or '':6s}"
                  + (f" UNSET {r['unset_bytes']}B" if r["unset_bytes"] else ""))
        rep = {"extras": {k: [str(v.dtype), list(v.shape)] for k, v in EXTRAS.items()}, "cmd": a.cmd, "src": a.src, "tp": a.tp, "rank": a.rank, "ep": a.ep, "load_s": round(t1 - t0, 2),
               "excludes_rewritten": config_copy(a.src)[1] if a.cmd == "default-load" else None,
               "keys": rows, "unset_checked": bool(a.unset), "stand_in_calls": stand_in_calls()}
        print(f"{len(rows)} keys, {sum(r['bytes'] for r in rows)} bytes, load {rep['load_s']} s;"
              f" unset: {'not checked' if unset is None else (unset or 'none')}")
        print("stand-in calls:", rep["stand_in_calls"])
        if a.out:
            pathlib.Path(a.out).write_text(json.dumps(rep, indent=1))
    elif a.cmd == "save-sharded-state":
        save_sharded_state(a.src, a.tp, a.out, ep=a.ep, **kw)
        print(f"wrote {a.out} in {time.time() - t0:.1f} s:", sorted(p.name for p in pathlib.Path(a.out).iterdir()))
    elif a.cmd == "roundtrip":
        save_sharded_state(a.src, a.tp, a.out, ep=a.ep, **kw)
        t1 = time.time()
        print(f"saved in {t1 - t0:.1f} s")
        ok = True
        for r in range(a.tp):
            d = default_load(a.src, a.tp, r, ep=a.ep, **kw)
            dx = dict(EXTRAS)
            s_ = sharded_state_load(a.out, a.tp, r, ep=a.ep, **kw)
            bad, badx = same(d, s_), same(dx, EXTRAS)
            ok &= not bad and not badx
            print(f"rank {r}: {len(d)} keys; sharded_state_load vs default_load:",
                  "byte-identical" if not bad else f"DIFFER {bad}", f"; {len(dx)} tensors outside state_dict "
                  f"({', '.join(sorted({k.rsplit('.', 1)[1] + ':' + str(v.dtype).replace('torch.', '') for k, v in dx.items()}))}):",
                  "byte-identical" if not badx else f"DIFFER {badx}")
        print(f"round trip {'OK' if ok else 'FAILED'} ({time.time() - t1:.1f} s for the loads)")
        print("stand-in calls:", stand_in_calls())
        return 0 if ok else 1
    elif a.cmd == "excludes":
        import re

        cfg = json.loads((pathlib.Path(a.src) / "config.json").read_text())
        n = cfg["num_hidden_layers"]
        names = [f"model.layers.{i}.self_attn.{m}" for i in (0, n) for m in
                 ("fused_qkv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj")]
        names += [f"model.layers.{n - 1}.mlp.{m}" for m in ("gate", "experts", "shared_experts.gate_up_proj",
                                                              "shared_experts.down_proj")]
        names += ["model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj", "lm_head",
                  f"model.layers.{n}.eh_proj", f"model.layers.{n}.mlp.experts", f"model.layers.{n}.shared_head.head"]
        print("exclude:", cfg["quantization_config"]["exclude"])
        for k, v in sglang_excluded(a.src, names).items():
            fn = any(re.fullmatch(re.escape(e).replace(r"\*", ".*"), k) for e in cfg["quantization_config"]["exclude"])
            print(f"  {k:55s} SGLang excludes: {v!s:5s}  shell-wildcard intent: {fn}")
        d, rw = config_copy(a.src)
        print("rewritten:", rw, "->", json.loads((d / "config.json").read_text())["quantization_config"]["exclude"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
