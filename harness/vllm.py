"""vLLM 0.34.0's real DeepSeek model and loaders, built and loaded on a CPU without ROCm, as vLLM
would on one MI355 (gfx950) with aiter (VLLM_ROCM_USE_AITER=1), and ``check-engine vllm``
(:func:`check`) on them. Run with .venv-vllm's Python (``bash scripts/setup_env.sh --vllm``: a
venv on top of .venv's packages, plus vllm==0.34.0 installed --no-deps; ``python -m harness``
switches to it). Built like :mod:`harness.sglang`.

What is real: all of ``vllm`` that builds and loads the model (``DeepseekV3ForCausalLM``,
``DefaultModelLoader``, the Quark config, ``QuarkOCP_MX`` linear scheme with its
``AiterMxfp4LinearKernel``, ``QuarkOCP_MX_MoEMethod`` with its MXFP4 MoE backend oracle, FusedMoE,
weight loaders, every ``process_weights_after_loading``), torch, transformers, safetensors, and
aiter's pure-Python files from an aiter source tree (``AITER_DIR``: ``aiter/ops/shuffle.py``,
``aiter/utility/fp4_utils.py``, ``dtypes``, ...) and from the amd-aiter wheel's files
(``AITER_ORACLE_DIR``: aiter's Triton ``quant``, interpreted: TRITON_INTERPRET=1), and the
tuned-shape tables of an aiter tree where one is given (``$PREP_AITER_TABLES``: vLLM asks them
which dense linears to shuffle). Without one, no shape is tuned, which is what aiter answers for
every shape of prep's tiny checkpoints: vLLM's two probes answer False (a stand-in, recorded).

Stand-ins (each call recorded in :data:`CALLS`):

* every other ``aiter`` module; ``aiter.jit.utils.chip_info`` answers gfx950 / 256 CUs;
* vLLM's compiled extensions (``vllm._C``, ``_rocm_C``, ``_moe_C``, ...: they link CUDA torch) and
  GPU packages (flashinfer, triton_kernels, amdsmi ...). ``amdsmi`` answers one gfx950 device, so
  vLLM resolves its ``RocmPlatform``;
* the platform: ``torch.version.hip`` set, ``torch.cuda`` answering as one MI355X;
  ``device="cuda"`` mapped to the CPU by a TorchFunctionMode which also fills ``torch.empty*``
  with one byte (so memory that loading never writes is visible);
* the process groups: one process plays TP rank r of N: vLLM's parallel-state getters
  (``get_tensor_model_parallel_rank/world_size``, ``get_tp_group``, ``get_ep_group``, ...)
  answer with fake GroupCoordinators.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import pathlib
import sys
import types
from typing import Iterator

from harness import REPO, freeze_imports

WORK = {"dir": REPO / ".cache" / "vllm-check"}
# aiter's source tree (the oracles' aiter-*.tar.gz, extracted by the caller: install(aiter_dir))
AITER = {"dir": pathlib.Path(os.environ.get("PREP_AITER_SRC", REPO / ".cache" / "aiter-src"))}
AITER_ORACLE_DIR = pathlib.Path(os.environ.get("PREP_AITER_DIR", REPO / ".cache" / "aiter-oracle"))
# An aiter tree with the files vLLM's tuned-shape probes read (the Triton GEMM config lookup and its
# JSON configs, the a4w4 GEMM tuned-CSV lookup and its CSVs), optional (module docstring)
AITER_FULL_DIR = pathlib.Path(os.environ.get("PREP_AITER_TABLES", "/nonexistent-aiter-tables"))
TABLES = {"present": (AITER_FULL_DIR / "aiter" / "ops" / "gemm_op_a4w4.py").is_file()}
GPU_ARCH = {"name": "gfx950", "cu_num": 256}

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_ROCM_USE_AITER", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_V1", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

from harness import mi355x, stand_ins  # noqa: E402
from harness.compare import compare  # noqa: E402
from harness.mi355x import on_cpu  # noqa: E402
from harness.report import RankResult  # noqa: E402
from harness.stand_ins import StandIn, StandInFinder, fill_aiter_enums, file_spec  # noqa: E402

CALLS = stand_ins.CALLS  # every call of a stand-in, by name, in order (stand_ins)


REAL_AITER = stand_ins.REAL_AITER
REAL_AITER_FULL = ("aiter.ops.gemm_op_a4w4", "aiter.ops.triton.utils.gemm_config_utils", "aiter.ops.triton.utils.core",
                   "aiter.ops.triton.utils._triton.arch_info")
REAL_AITER_ORACLE = ("aiter.ops.triton.quant", "aiter.ops.triton._triton_kernels.quant",
                     "aiter.ops.triton.utils.logger")
# GPU-only packages that get a stand-in when not importable here
STANDIN_PACKAGES = {"aiter", "amdsmi", "flashinfer", "deep_gemm", "deep_ep", "flash_mla", "quack",
                    "cutlass", "tilelang", "humming", "pynvml", "mori", "nvshmem", "tvm_ffi", "torchvision",
                    "xgrammar", "llguidance", "outlines_core", "lm_format_enforcer", "cuda", "fastsafetensors",
                    "instanttensor", "numba", "torchaudio", "torchcodec", "tokenspeed_mla", "nvtx"}
# vLLM's compiled extensions (link CUDA torch: cannot load here)
STANDIN_MODULES = {"vllm._C", "vllm._rocm_C", "vllm._moe_C", "vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch",
                   "vllm.cumem_allocator", "vllm._flashmla_C", "vllm._flashmla_extension_C", "vllm._deepselect_C",
                   "vllm._flashkda_C", "vllm.fs_io_C", "vllm.spinloop"}
HIDDEN_FROM_TRANSFORMERS = {"torchvision", "torchaudio", "torchcodec", "numba"}


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in REAL_AITER + REAL_AITER_FULL + REAL_AITER_ORACLE:  # `from pkg import real_submodule`
            return importlib.import_module(full)
        return StandIn(full)


class _Finder(StandInFinder):
    def __init__(self):
        super().__init__(STANDIN_PACKAGES, always=("aiter", "amdsmi"), hidden=HIDDEN_FROM_TRANSFORMERS)

    def find_spec(self, name, path, target=None):
        if name in STANDIN_MODULES:  # vLLM's compiled extensions, whatever its package has
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return super().find_spec(name, path, target)

    def aiter_root(self) -> pathlib.Path:
        return AITER["dir"]

    def source(self, name):
        if name in REAL_AITER:
            return file_spec(name, AITER["dir"])
        if name == "aiter.ops.triton.gemm_afp4wfp4":  # the wheel's Triton MXFP4 GEMM, interpreted (prep's loader)
            return importlib.machinery.ModuleSpec(name, _GemmLoader())
        if name in REAL_AITER_FULL and TABLES["present"]:
            return file_spec(name, AITER_FULL_DIR)
        if name in REAL_AITER_ORACLE:
            return file_spec(name, AITER_ORACLE_DIR)
        return None

    def module_for(self, name: str) -> type:
        return _StandInModule

    def create_module(self, spec):
        m = super().create_module(spec)
        m.__version__ = "0.0.0"
        m.__file__ = f"<stand-in {spec.name}>"
        return m

    def exec_module(self, m):
        n = m.__name__
        if n == "aiter":
            aiter_enum, dtypes = (importlib.import_module(x) for x in ("aiter.ops.enum", "aiter.utility.dtypes"))
            m.dtypes, m.QuantType, m.ActivationType = dtypes, aiter_enum.QuantType, aiter_enum.ActivationType
            # the preshuffled per-token FP8 GEMM (an FP8 per-channel kv_b_proj on it, which MLA runs on
            # an identity at load): torch math; its weight is always shuffled (vLLM marks none)
            m.gemm_a8w8_bpreshuffle = functools.partial(stand_ins.gemm_a8w8_bpreshuffle, shuffled=True)
        elif n == "aiter.ops.enum":
            fill_aiter_enums(m)
        elif n == "aiter.utility.aiter_types":  # the tree lacks csrc/include/aiter_enum.h, which it parses
            names = "fp8 fp8_e8m0 fp16 bf16 fp32 i4x2 fp4x2 u32 i32 i16 i8".split()
            m.aiter_dtypes = {x: i for i, x in enumerate(names)}
            m.aiter_tensor_t = type("aiter_tensor_t", (), {})
        elif n == "aiter.jit.utils.chip_info":
            m.get_gfx = m.get_gfx_runtime = lambda: GPU_ARCH["name"]
            m.get_cu_num = lambda: GPU_ARCH["cu_num"]
        elif n == "aiter.jit.core" and TABLES["present"]:
            m.AITER_CONFIGS = types.SimpleNamespace(AITER_CONFIG_GEMM_A4W4_FILE=str(_a4w4_tuned_csv()))
            m.AITER_LOG_TUNED_CONFIG = 0
            m.AITER_TRITON_CONFIGS_PATH = str(AITER_FULL_DIR / "aiter/ops/triton/configs")
        elif n == "aiter.ops.quant":  # vLLM's per-token FP8 quant (FP8 per-channel linears): torch math
            m.dynamic_per_token_scaled_quant = stand_ins.dynamic_per_token_scaled_quant
        elif n == "amdsmi":
            _fill_amdsmi(m)


class _GemmLoader(importlib.abc.Loader):
    """aiter.ops.triton.gemm_afp4wfp4 = the amd-aiter wheel's gemm_afp4wfp4.py (AITER_ORACLE_DIR), loaded and
    interpreted by prep.reference.aiter_gemm (the project's loader of aiter's own GEMMs on the CPU). vLLM calls it
    while loading only to derive MLA's W_UK/W_UV from an MXFP4 kv_b_proj (layer.quant_method.apply on eye(K))."""

    def create_module(self, spec):
        from prep.reference import aiter_gemm

        loaded = aiter_gemm.gemm_module(AITER_ORACLE_DIR)
        m = types.ModuleType(spec.name)
        m.__dict__.update({k: v for k, v in loaded.__dict__.items() if not k.startswith("__")})

        # the kernel reads each scale row 8 columns at a time, unmasked: past the end of both scales
        # for K % 256 != 0; defined bytes there, as on a GPU
        m.gemm_afp4wfp4 = aiter_gemm.with_defined_overread(loaded.gemm_afp4wfp4)
        if not hasattr(m, "gemm_afp4wfp4_preshuffle"):  # e4048607's name; the wheel's differs (ASM path only)
            m.gemm_afp4wfp4_preshuffle = getattr(m, "gemm_afp4wfp4_preshuffled_weight_scales", None) or StandIn(
                "aiter.ops.triton.gemm_afp4wfp4.gemm_afp4wfp4_preshuffle")
        return m

    def exec_module(self, m):
        pass


def _a4w4_tuned_csv() -> pathlib.Path:
    """What aiter's AITER_CONFIGS.AITER_CONFIG_GEMM_A4W4_FILE gives without $AITER_CONFIG_GEMM_A4W4:
    configs/a4w4_blockscale_tuned_gemm.csv merged with configs/model_configs/*a4w4_blockscale_tuned_gemm*.csv
    (jit/core.py get_config_file / update_config_files; the lookup only asks whether a key exists)."""
    import pandas as pd

    cfg = AITER_FULL_DIR / "aiter" / "configs"
    files = [cfg / "a4w4_blockscale_tuned_gemm.csv"] + sorted(
        p for p in (cfg / "model_configs").glob("*a4w4_blockscale_tuned_gemm*.csv") if "untuned" not in p.name)
    out = WORK["dir"] / "a4w4_blockscale_tuned_gemm.merged.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.concat([pd.read_csv(f) for f in files], ignore_index=True).to_csv(out, index=False)
    return out


def _fill_amdsmi(m):
    class AmdSmiException(Exception):
        pass

    m.AmdSmiException = AmdSmiException
    m.AmdSmiMemoryType = types.SimpleNamespace(VRAM=0)
    m.amdsmi_init = m.amdsmi_shut_down = lambda *a, **k: None
    m.amdsmi_get_processor_handles = lambda: ["gpu0"]
    m.amdsmi_get_gpu_asic_info = lambda h: {"target_graphics_version": GPU_ARCH["name"], "market_name":
                                            "AMD Instinct MI355X", "device_id": "0x75a3"}
    m.amdsmi_get_gpu_memory_total = lambda *a: 288 << 30
    m.amdsmi_get_gpu_device_uuid = lambda *a: "00000000-0000-0000-0000-000000000000"
    m.amdsmi_topo_get_link_type = lambda *a: {"hops": 1, "type": 2}
    m.amdsmi_topo_get_numa_node_number = lambda *a: 0


# ---------------------------------------------------------------- the platform: one MI355 (gfx950), harness.mi355x

def _patch_torch() -> None:
    """One MI355X (:mod:`harness.mi355x`), and what vLLM asks of torch beyond it."""
    import torch._dynamo  # noqa: F401  (before torch.cuda answers as compiled: they probe it at import)
    import torch._inductor.custom_graph_pass  # noqa: F401
    import torch._inductor.utils  # noqa: F401

    mi355x.patch_torch()
    c = torch.cuda
    c._is_compiled = lambda: True
    c._device_count_amdsmi = lambda: 1
    acc = torch.accelerator
    acc.empty_cache = lambda *a, **k: None
    acc.max_memory_allocated = lambda *a, **k: 0
    acc.synchronize = lambda *a, **k: None
    acc.current_device_index = lambda *a, **k: 0


_INSTALLED = {"done": False}
_LIBS: list = []


# vLLM's compiled op namespaces (registered by vllm._C & co., which cannot load here)
STANDIN_OP_NAMESPACES = ("_C", "_rocm_C", "_moe_C", "_C_cache_ops", "_C_custom_ar", "_C_cuda_utils", "_flashmla_C",
                         "_flashmla_extension_C", "_vllm_fa", "_flashkda_C")


def install(aiter_dir: str | os.PathLike | None = None) -> None:
    """Stand-ins and platform patches (module docstring); ``aiter_dir``: an aiter source tree
    (default ``$PREP_AITER_SRC``, else ``.cache/aiter-src``)."""
    if _INSTALLED["done"]:
        return
    if aiter_dir is not None:
        AITER["dir"] = pathlib.Path(aiter_dir)
    if not (AITER["dir"] / "aiter" / "ops" / "shuffle.py").is_file():
        raise SystemExit(f"{AITER['dir']}: no aiter/ops/shuffle.py; pass an aiter source tree (the oracles' "
                         "aiter-*.tar.gz, extracted)")
    _patch_torch()
    from triton.runtime import driver as triton_driver

    triton_driver.set_active(mi355x.TritonHipDriver())
    for ns in STANDIN_OP_NAMESPACES:
        setattr(torch.ops, ns, StandIn(f"torch.ops.{ns}"))
    real_register_fake = torch.library.register_fake

    def register_fake(op, *a, **k):  # fake impls of the stand-in namespaces' ops: nothing to register
        if isinstance(op, str) and op.split("::")[0] in STANDIN_OP_NAMESPACES:
            return (lambda f: f) if not a else a[0]
        return real_register_fake(op, *a, **k)

    torch.library.register_fake = register_fake
    sys.meta_path.insert(0, _Finder())
    _INSTALLED["done"] = True
    import vllm.model_executor.kernels.linear.mxfp4.aiter as vk

    # vLLM registers its aiter MXFP4 GEMM op for the platform's dispatch key (CUDA): the same function for the CPU
    _LIBS.append(torch.library.Library("vllm", "IMPL"))
    _LIBS[-1].impl("gemm_with_dynamic_quant", vk.gemm_with_dynamic_quant, "CPU")
    # and its per-token FP8 quant (vLLM's own op body, which calls aiter's kernel: a stand-in)
    from vllm import _aiter_ops

    _LIBS[-1].impl("rocm_aiter_per_token_quant", _aiter_ops._rocm_aiter_per_token_quant_impl, "CPU")
    _LIBS[-1].impl("_rocm_aiter_preshuffled_per_token_w8a8_gemm",
                   _aiter_ops._rocm_aiter_preshuffled_per_token_w8a8_gemm_impl, "CPU")
    if not TABLES["present"]:  # no aiter tables: no shape is tuned (module docstring)
        from vllm._aiter_ops import rocm_aiter_ops

        def untuned(probe: str):
            def answer(n: int, k: int, *dtype) -> bool:  # the a8w8 probes take the weight dtype too
                CALLS.append(f"aiter tuned-shape table (absent): {probe}")
                return False
            return staticmethod(answer)

        rocm_aiter_ops.is_asm_fp4_gemm_tuned = untuned("is_asm_fp4_gemm_tuned")
        rocm_aiter_ops.is_triton_gemm_afp4wfp4_presh_ws_tuned = untuned("is_triton_gemm_afp4wfp4_presh_ws_tuned")
        # the FP8 per-channel linears' (Quark's FP8 attention): aiter's CK a8w8 GEMMs, shuffled or not
        rocm_aiter_ops.is_shuffled_per_token_w8a8_gemm_tuned = untuned("is_shuffled_per_token_w8a8_gemm_tuned")
        rocm_aiter_ops.is_per_token_w8a8_gemm_tuned = untuned("is_per_token_w8a8_gemm_tuned")


# ---------------------------------------------------------------- process groups: one process, any rank

class _FakePG:
    """torch.distributed ProcessGroup stand-in: rank()/size()."""

    def __init__(self, rank, size):
        self._r, self._n = rank, size

    def rank(self):
        return self._r

    def size(self):
        return self._n


class FakeGroup:
    """A GroupCoordinator for one process playing ``rank_in_group`` of ``world_size``: sizes and
    ranks are answered; every collective or other method is a recorded stand-in."""

    def __init__(self, name: str, rank: int, size: int):
        self.unique_name = self.name = name
        self.rank_in_group, self.world_size = rank, size
        self.rank = self.local_rank = rank
        self.ranks = list(range(size))
        self.first_rank, self.last_rank = 0, size - 1
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1
        self.device = torch.device("cpu")
        self.cpu_group = self.device_group = _FakePG(rank, size)
        self.use_device_communicator = False
        self.device_communicator = None
        self.mq_broadcaster = None

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn(f"group[{self.__dict__.get('name')}].{name}")

    def __repr__(self):
        return f"<FakeGroup {self.name} {self.rank_in_group}/{self.world_size}>"


def set_groups(tp: int, rank: int, ep: int = 1) -> dict:
    """vLLM's parallel-state globals answered for TP rank RANK of TP (one node, no PP/DP/DCP/PCP).
    vLLM's EP group, when expert parallel is on, spans DP x PCP x TP: here TP ranks."""
    import vllm.distributed.parallel_state as ps

    groups = {"_WORLD": FakeGroup("world", rank, tp), "_TP": FakeGroup("tp", rank, tp),
              "_PP": FakeGroup("pp", 0, 1), "_DP": FakeGroup("dp", 0, 1), "_DCP": FakeGroup("dcp", 0, 1),
              "_PCP": FakeGroup("pcp", 0, 1), "_EP": FakeGroup("ep", rank, tp), "_EPLB": FakeGroup("eplb", rank, tp),
              "_ETP": FakeGroup("etp", rank if ep == 1 else 0, tp if ep == 1 else 1),
              "_INNER_DP_WORLD": FakeGroup("inner_dp_world", rank, tp)}
    for k, v in groups.items():
        if hasattr(ps, k):
            setattr(ps, k, v)
    ps._NODE_COUNT = 1
    return groups


# ---------------------------------------------------------------- config and loading

def make_vllm_config(model_path, tp: int, ep: int = 1, load_format: str = "auto", **engine_kw):
    """vLLM's own EngineArgs -> VllmConfig, for a TP-sized ROCm deployment."""
    install()
    from vllm.engine.arg_utils import EngineArgs

    # vLLM refuses a max_model_len past the config's max_position_embeddings (an amd-quark export
    # of a tiny model has 256); nothing here runs a sequence, so the smaller of the two.
    positions = json.loads((pathlib.Path(model_path) / "config.json").read_text()).get("max_position_embeddings")
    kw = dict(model=str(model_path), tensor_parallel_size=tp, enable_expert_parallel=ep > 1, load_format=load_format,
              skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, trust_remote_code=False,
              max_model_len=min(1024, positions or 1024), distributed_executor_backend="uni" if tp == 1 else "mp")
    kw.update(engine_kw)
    return EngineArgs(**kw).create_engine_config()


MODEL = {}


def _state_dict(model) -> dict:
    """A clone of ``model``'s state dict (what the check compares: aliases, MLA's derived W_UK_T /
    W_UV and the scalars are in it)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


MTP_SPECULATIVE = {"method": "mtp", "num_speculative_tokens": 1}  # vLLM's MTP draft, as a user asks for it


def build_and_load(model_path, tp: int, rank: int, ep: int = 1, load_format: str = "auto", fill: int = 0xA5,
                   draft: bool = False, **engine_kw):
    """vLLM's own loader for LOAD_FORMAT (get_model_loader(...).load_model) as rank RANK of TP.
    ``draft``: with ``--speculative-config`` MTP_SPECULATIVE, and the MTP draft loaded after the
    model as vLLM's MTP speculator loads it (``load_eagle_model``: the same loader, then the
    main model's embedding and head shared into it), in ``MODEL["draft"]``."""
    if draft:
        engine_kw["speculative_config"] = MTP_SPECULATIVE
    vc = make_vllm_config(model_path, tp, ep, load_format, **engine_kw)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    set_groups(tp, rank, ep)
    loader = get_model_loader(vc.load_config)
    freeze_imports()
    from vllm.v1.worker import workspace

    if workspace._manager is None:  # GPUModelRunner makes it; DeepSeek-V3.2's sparse MLA asks for it at build
        workspace.init_workspace_manager(torch.device("cpu"))
    with set_current_vllm_config(vc), on_cpu(fill):
        model = loader.load_model(vllm_config=vc, model_config=vc.model_config)
        if draft:
            from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

            MODEL["draft"] = load_eagle_model(model, vc)
    MODEL.update(model=model, loader=loader, config=vc)
    return model, loader


# ---------------------------------------------------------------- what vLLM chose, per module

def force_asm_tuned() -> None:
    """Make vLLM's tuned-shape probes answer True for every (N, K), so the tiny MXFP4 linears take
    the ASM/preshuffle branch of AiterMxfp4LinearKernel, and the FP8 per-channel ones whose N is a
    multiple of 128 aiter's preshuffled per-token GEMM (to see those branches' bytes)."""
    install()
    from vllm._aiter_ops import rocm_aiter_ops

    rocm_aiter_ops.is_asm_fp4_gemm_tuned = staticmethod(lambda n, k: True)
    rocm_aiter_ops.is_triton_gemm_afp4wfp4_presh_ws_tuned = staticmethod(lambda n, k: True)
    # FP8 per channel: where N is a multiple of 128 only, so that a checkpoint's FP8 linears take
    # both of vLLM's FP8 layouts in one load (the preshuffled GEMM's, and the transposed view)
    rocm_aiter_ops.is_shuffled_per_token_w8a8_gemm_tuned = staticmethod(lambda n, k, dtype: n % 128 == 0)


def dense_kernels(model) -> dict[str, int]:
    """How many of ``model``'s quantized dense linears vLLM runs on each GEMM (MXFP4: aiter's ASM
    GEMM on shuffled bytes, or its Triton GEMM on raw ones; FP8 per channel: its linear kernel's
    class), as vLLM chose them at processing."""
    from collections import Counter

    out: Counter = Counter()
    for _, mod in model.named_modules():
        sch = getattr(mod, "scheme", None)
        mx, fp8 = getattr(sch, "ocp_mx_linear", None), getattr(sch, "fp8_linear", None)
        if mx is not None:
            out["MXFP4 " + ("ASM GEMM (shuffled)" if getattr(mx, "use_asm_gemm", False) else "Triton GEMM (raw)")] += 1
        elif fp8 is not None:
            out[f"FP8 {type(fp8).__name__}"] += 1
    return dict(sorted(out.items()))


# ---------------------------------------------------------------- check-engine vllm

# Stand-ins vLLM calls in both loads alike that do no loading work: decorators and the log line of
# aiter's config lookup as vLLM imports its kernels, the padded-M helper of the ASM GEMM probe, and
# the tuned-shape probes where no aiter tables are given (module docstring).
# numba.njit: the decorator of vLLM's Kimi-K2.5 image preprocessing (kimi_k25_vision_fused.py), applied
# as the module is imported; no weight passes through it
ALLOWED = ("aiter.jit.core.compile_ops", "aiter.jit.utils.torch_guard.torch_compile_guard", "aiter.logger",
           "aiter.ops.gemm_op_common.get_padded_m", "aiter tuned-shape table (absent)", "numba.njit")


def _shuffled(model) -> dict[str, bool]:
    """``is_shuffled`` of every parameter (absent read as False, as aiter reads it): what aiter's
    kernels take the bytes' order from."""
    return {n: bool(getattr(p, "is_shuffled", False)) for n, p in model.named_parameters()}


def check(src: pathlib.Path, out: pathlib.Path, work: pathlib.Path, aiter_src: pathlib.Path, asm_tuned: bool = False,
          ranks: list[int] | None = None) -> Iterator[str | RankResult]:
    """``check-engine vllm``: vLLM's ``DefaultModelLoader`` on ``src`` against ``--load-format
    prep`` on ``out`` (which vLLM finds through the package's ``vllm.general_plugins`` entry
    point, as in every vLLM process: not registered here), rank by rank (``ranks``, default all),
    with the MTP draft where the source has an MTP layer: every state-dict tensor (vLLM holds what it
    derives at load there), ``is_shuffled``
    and the GEMM vLLM chose for each dense linear. ``asm_tuned``: aiter's tuned-shape probes
    answer yes (:func:`force_asm_tuned`). Yields what to say, then each rank."""
    from harness import converted
    from layouts.engines.vllm.door import LOAD_FORMAT

    t = converted.target(out, "vllm")
    WORK["dir"] = work
    install(aiter_src)
    override, said = converted.config_override(out, "--hf-overrides")
    yield from said
    kw = {"hf_overrides": override} if override else {}
    if asm_tuned:
        force_asm_tuned()
        yield ("aiter's tuned-shape probes answer yes for every shape (--asm-tuned): vLLM runs each dense linear whose "
               "scale it can swizzle on the ASM FP4 GEMM, each FP8 per-channel linear on aiter's preshuffled FP8 GEMM")
    elif not TABLES["present"]:
        yield ("aiter's tuned-shape tables: none given ($PREP_AITER_TABLES), so vLLM shuffles no dense linear (what "
               "aiter answers for every tiny shape)")
    # With an MTP layer, vLLM's MTP draft too (--speculative-config), loaded after the model. Not
    # where config.json says one and the checkpoint has none (an amd-quark export made with
    # transformers 5): vLLM's own load leaves such a draft unwritten, prep's door refuses it.
    import layouts

    layers = json.loads((src / "config.json").read_text()).get("num_hidden_layers")
    draft = any(n.startswith(f"model.layers.{layers}.") for n in layouts.load_manifest(out).source.tensors)
    if draft:
        yield f"both loads: --speculative-config '{json.dumps(MTP_SPECULATIVE)}', the MTP draft compared too"

    def load(folder: pathlib.Path, load_format: str, fill: int, rank: int):
        """``(state dict, is_shuffled flags, GEMMs chosen, loader class)`` of one load."""
        model, loader = build_and_load(folder, t.tp, rank, t.ep, load_format, fill=fill, draft=draft, **kw)
        state, flags, kernels = _state_dict(model), _shuffled(model), dense_kernels(model)
        if draft:
            m = MODEL.pop("draft")
            state.update({f"draft:{k}": x for k, x in _state_dict(m).items()})
            flags.update({f"draft:{k}": x for k, x in _shuffled(m).items()})
            kernels.update({f"draft {k}": n for k, n in dense_kernels(m).items()})
        MODEL.clear()
        return state, flags, kernels, type(loader)

    for rank in ranks if ranks is not None else range(t.tp):
        CALLS.clear()
        own, own_flags, own_kernels, _ = load(src, "auto", 0xA5, rank)
        door, door_flags, door_kernels, loader = load(out, LOAD_FORMAT, 0x5A, rank)
        compared = compare(own, door)
        bad = compared.problems
        bad += [f"{n}: is_shuffled {own_flags[n]} in vLLM's own load, {door_flags.get(n)} through the door"
                for n in own_flags if own_flags[n] != door_flags.get(n)]
        bad += [f"vLLM loaded OUT with {loader.__name__}, not prep's loader"] * (loader.__name__ != "PrepModelLoader")
        bad += [f"stand-in called while loading: {c}" for c in stand_ins.skipped(CALLS) if not c.startswith(ALLOWED)]
        bad += [f"vLLM chose other GEMMs for OUT ({door_kernels}) than for SRC ({own_kernels})"] * (
            door_kernels != own_kernels)
        notes = [f"dense linears by vLLM's GEMM: {', '.join(f'{k} {n}' for k, n in own_kernels.items()) or 'none'}"]
        note = stand_ins.computed_note(CALLS)  # torch math for a GPU kernel, the same in both loads
        notes += [note] if note else []
        yield RankResult(engine="vllm", rank=rank, tp=t.tp, tensors=len(own),
                         draft=sum(k.startswith("draft:") for k in own) if draft else None, bytes_equal=compared.equal, problems=bad, notes=notes)
