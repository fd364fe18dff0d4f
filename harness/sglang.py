"""SGLang 0.5.23's real DeepSeek model and loaders, built and loaded on a CPU without ROCm, and
``check-engine sglang`` (:func:`check`) on them; run with .venv-sglang's Python (``bash
scripts/setup_env.sh --sglang``; ``python -m harness`` switches to it). Built like
:mod:`harness.atom.on_cpu`.

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

import json
import os
import pathlib
import sys
from typing import Iterator

from harness import REPO, freeze_imports

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

from harness import mi355x, stand_ins  # noqa: E402
from harness.compare import compare  # noqa: E402
from harness.mi355x import on_cpu  # noqa: E402
from harness.report import RankResult  # noqa: E402
from harness.stand_ins import StandIn, StandInFinder, fill_aiter_stub, file_spec  # noqa: E402

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


class _Finder(StandInFinder):
    def __init__(self, aiter_root: pathlib.Path):
        super().__init__(STANDIN_PACKAGES, hidden=HIDDEN_FROM_TRANSFORMERS,
                         hidden_from="transformers.utils.import_utils")
        self.root = aiter_root

    def aiter_root(self) -> pathlib.Path:
        return self.root

    def source(self, name):
        if name in REAL_AITER:
            return file_spec(name, self.root)
        if name in REAL_AITER_ORACLE:
            return file_spec(name, AITER_ORACLE_DIR)
        return None

    def exec_module(self, m):
        fill_aiter_stub(m, lambda: GPU_ARCH["name"])


# ---------------------------------------------------------------- the platform: one MI355 (gfx950), harness.mi355x

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
    freeze_imports()
    with on_cpu(fill):
        model = loader.load_model(model_config=mc, device_config=dc)
    return model, loader


def default_load(src, tp: int, rank: int, ep: int = 1, fill: int = 0xA5, **kw) -> dict:
    """DefaultModelLoader: load_weights (whose DeepSeek loader ends with post_load_weights), then
    every quant method's process_weights_after_loading. Returns model.state_dict() (clones).
    ``kw``: ServerArgs fields (a config whose Quark excludes SGLang cannot match needs
    ``json_model_override_args``)."""
    model, loader = build_and_load(src, tp, rank, "auto", ep=ep, fill=fill, **kw)
    assert type(loader).__name__ == "DefaultModelLoader", type(loader)
    return _state_dict(model)


def sharded_state_load(folder, tp: int, rank: int, ep: int = 1, fill: int = 0xA5, **kw) -> dict:
    """ShardedStateLoader.load_model on FOLDER (config.json + model-rank-{r}-part-{n}.safetensors)."""
    model, loader = build_and_load(folder, tp, rank, "sharded_state", ep=ep, fill=fill, **kw)
    assert type(loader).__name__ == "ShardedStateLoader", type(loader)
    return _state_dict(model)


# ---------------------------------------------------------------- check-engine sglang

# Stand-ins SGLang calls while building its model, each used only in the forward pass (so a
# stand-in skips no loading work); any other stand-in call fails the check.
BUILD_ONLY = {
    "aiter.rotary_embedding.get_rope": "builds each layer's RoPE module (forward only; its cos/sin caches are not "
                                       "persistent, so not in the state dict)",
    "aiter.get_hip_quant": "looked up when SGLang's MXFP4 linear module is imported (the activation quant of its "
                           "forward)",
    "aiter.jit.core.compile_ops": "decorates aiter's JIT kernels as SGLang imports them",
}


def check(src: pathlib.Path, out: pathlib.Path, aiter_src: pathlib.Path,
          ranks: list[int] | None = None) -> Iterator[str | RankResult]:
    """``check-engine sglang``: SGLang's ``DefaultModelLoader`` on ``src`` against its
    ``ShardedStateLoader`` on ``out`` (``--load-format sharded_state`` with prep's file names, as
    the serve command prep printed asks for it), rank by rank (``ranks``, default all): every
    state-dict tensor, and the MLA ``w_kc`` / ``w_vc`` (and scales) SGLang derives after loading.
    SGLang is told the shared-expert fusion and EP size the manifest records. The two loads fill
    uninitialised memory with different bytes (0xA5, 0x5A), so a byte neither writes differs.
    Yields what to say, then each rank."""
    from harness import converted

    t = converted.target(out, "sglang")
    install(aiter_src)
    kw = {"enforce_shared_experts_fusion": True} if t.fuse_shared_expert else {"disable_shared_experts_fusion": True}
    override, said = converted.config_override(out, "--json-model-override-args")
    yield from said
    if override:
        kw["json_model_override_args"] = json.dumps(override)
    pattern = json.dumps({"pattern": f"model-tp{t.tp}-rank{{rank}}-{{part}}.safetensors"})
    for rank in ranks if ranks is not None else range(t.tp):
        CALLS.clear()
        own = default_load(src, t.tp, rank, ep=t.ep, **kw)
        own_extra = dict(EXTRAS)
        door = sharded_state_load(out, t.tp, rank, ep=t.ep, fill=0x5A, model_loader_extra_config=pattern, **kw)
        compared = compare({**own, **own_extra}, {**door, **EXTRAS})
        called = sorted({c for c in CALLS if c not in BUILD_ONLY})
        yield RankResult(engine="sglang", rank=rank, tp=t.tp, tensors=len(own), derived=len(own_extra),
                         bytes_equal=compared.equal,
                         problems=compared.problems + [f"stand-in called while loading: {c}" for c in called])
