"""vLLM 0.34.0's real DeepSeek model and loaders, built and loaded on a CPU without ROCm, as vLLM
would on one MI355 (gfx950) with aiter (VLLM_ROCM_USE_AITER=1), for scripts/check_engine_install.py
--engine vllm. Run with .venv-vllm's Python (``bash scripts/setup_env.sh --vllm``: a venv on top
of .venv's packages, plus vllm==0.34.0 installed --no-deps). Built like scripts/sglang_on_cpu.py.

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

import argparse
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import pathlib
import re
import sys
import time
import types

REPO = pathlib.Path(__file__).resolve().parent.parent
MAIN = REPO  # prep and layouts, read from the repository
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # scripts/, for the shared stand-ins
import stand_ins  # noqa: E402
import mi355x  # noqa: E402
from mi355x import on_cpu  # noqa: E402
from stand_ins import called_from  # noqa: E402
from stand_ins import StandIn, fill_aiter_enums  # noqa: E402

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


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self.absent = {p for p in STANDIN_PACKAGES if p in ("aiter", "amdsmi") or importlib.util.find_spec(p) is None}
        self.made: set[str] = set()

    def find_spec(self, name, path, target=None):
        top = name.partition(".")[0]
        if name in STANDIN_MODULES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if top not in self.absent:
            return None
        if top in HIDDEN_FROM_TRANSFORMERS and called_from("transformers"):
            return None
        if name == "aiter.utility.aiter_types" and not (AITER["dir"] / "csrc/include/aiter_enum.h").is_file():
            return importlib.machinery.ModuleSpec(name, self)
        if name in REAL_AITER:
            return importlib.util.spec_from_file_location(name, AITER["dir"] / (name.replace(".", "/") + ".py"))
        if name == "aiter.ops.triton.gemm_afp4wfp4":  # the wheel's Triton MXFP4 GEMM, interpreted (prep's loader)
            return importlib.machinery.ModuleSpec(name, _GemmLoader())
        if name in REAL_AITER_FULL and TABLES["present"]:
            return importlib.util.spec_from_file_location(name, AITER_FULL_DIR / (name.replace(".", "/") + ".py"))
        if name in REAL_AITER_ORACLE:
            return importlib.util.spec_from_file_location(name, AITER_ORACLE_DIR / (name.replace(".", "/") + ".py"))
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = _StandInModule(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0"
        m.__file__ = f"<stand-in {spec.name}>"
        self.made.add(spec.name)
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
        if str(MAIN) not in sys.path:
            sys.path.append(str(MAIN))  # prep and layouts, read from the repository (not installed here)
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


# ---------------------------------------------------------------- the platform: one MI355 (gfx950), scripts/mi355x.py

def _patch_torch() -> None:
    """One MI355X (scripts/mi355x.py), and what vLLM asks of torch beyond it."""
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


# ---------------------------------------------------------------- Quark excludes

def config_copy(src: str | os.PathLike, dst: str | os.PathLike | None = None) -> tuple[pathlib.Path, list]:
    """:func:`stand_ins.config_copy` into this harness's work folder by default."""
    return stand_ins.config_copy(src, dst or WORK["dir"] / (pathlib.Path(src).name + "-re-excludes"))


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


EXTRAS: dict = {}  # the last load's tensors held outside state_dict (e.g. MLA W_UK/W_UV), by name
MODEL = {}


def _state_dict(model) -> dict:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    EXTRAS.clear()
    ids = {id(v) for v in model.state_dict(keep_vars=True).values()}
    seen = set()
    for mname, mod in model.named_modules():
        objs = [("", vars(mod))]
        qm = getattr(mod, "quant_method", None)
        if qm is not None:
            objs.append(("quant_method.", vars(qm)))
            k = getattr(qm, "moe_kernel", None)
            if k is not None:
                objs.append(("quant_method.moe_kernel.", vars(k)))
        for prefix, d in objs:
            for a, v in d.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and id(v) not in ids \
                        and id(v) not in seen and a not in ("_buffers", "_parameters"):
                    if a.startswith("_") and a not in ("_k_scale", "_v_scale", "_q_scale"):
                        continue
                    seen.add(id(v))
                    EXTRAS[f"{mname}.{prefix}{a}"] = v.detach().clone()
    return sd


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


def default_load(src, tp: int, rank: int, ep: int = 1, fill: int = 0xA5, **kw) -> dict:
    """DefaultModelLoader.load_model: load_weights, then every module's
    process_weights_after_loading. Returns model.state_dict() (clones); EXTRAS: the rest."""
    folder, _ = config_copy(src)
    model, loader = build_and_load(folder, tp, rank, ep, "auto", fill=fill, **kw)
    assert type(loader).__name__ == "DefaultModelLoader", type(loader)
    return _state_dict(model)



# ---------------------------------------------------------------- what vLLM chose, per module

def force_asm_tuned(on: bool = True) -> None:
    """Make vLLM's tuned-shape probes answer True for every (N, K), so the tiny MXFP4 linears take
    the ASM/preshuffle branch of AiterMxfp4LinearKernel, and the FP8 per-channel ones whose N is a
    multiple of 128 aiter's preshuffled per-token GEMM (to see those branches' bytes)."""
    install()
    from vllm._aiter_ops import rocm_aiter_ops

    if on:
        rocm_aiter_ops.is_asm_fp4_gemm_tuned = staticmethod(lambda n, k: True)
        rocm_aiter_ops.is_triton_gemm_afp4wfp4_presh_ws_tuned = staticmethod(lambda n, k: True)
        # FP8 per channel: where N is a multiple of 128 only, so that a checkpoint's FP8 linears take
        # both of vLLM's FP8 layouts in one load (the preshuffled GEMM's, and the transposed view)
        rocm_aiter_ops.is_shuffled_per_token_w8a8_gemm_tuned = staticmethod(lambda n, k, dtype: n % 128 == 0)


def choices(model) -> dict:
    """Per quantized module: the quant method, the linear kernel and its use_asm_gemm, the MoE
    backend / experts class / sizes; and which state-dict names are aliases of others."""
    out = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is None:
            continue
        d = {"quant_method": type(qm).__name__}
        sch = getattr(mod, "scheme", None) or getattr(qm, "scheme", None)
        if sch is not None:
            d["scheme"] = type(sch).__name__
            k = getattr(sch, "ocp_mx_linear", None)
            if k is not None:
                d["kernel"] = type(k).__name__
                d["use_asm_gemm"] = getattr(k, "use_asm_gemm", None)
        if hasattr(qm, "mxfp4_backend"):
            d["mxfp4_backend"] = str(qm.mxfp4_backend.value)
            d["experts_cls"] = getattr(qm.experts_cls, "__name__", str(qm.experts_cls))
            mk = getattr(qm, "moe_kernel", None)
            if mk is not None:
                d["fused_experts"] = type(mk.fused_experts).__name__
            for a in ("intermediate_size_per_partition", "hidden_size", "local_num_experts", "global_num_experts",
                      "num_fused_shared_experts"):
                if hasattr(mod, a):
                    d[a] = getattr(mod, a)
            for a in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
                t = getattr(mod, a, None)
                if t is not None:
                    d[a + ".is_shuffled"] = bool(getattr(t, "is_shuffled", False))
        out[name] = d
    return out


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


def aliases(model) -> dict:
    """state-dict name -> the first name holding the same tensor (vLLM registers some modules
    twice: MLA's mla_attn wrapper, FusedMoE's gate and _shared_experts)."""
    first, out = {}, {}
    for k, v in model.state_dict(keep_vars=True).items():
        key = (v.data_ptr(), v.dtype, tuple(v.shape), tuple(v.stride()))
        if key in first:
            out[k] = first[key]
        else:
            first[key] = k
    return out


def loaded_from_checkpoint(src) -> set:
    from safetensors import safe_open

    names = set()
    for f in pathlib.Path(src).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    return names


def unset_bytes(src, tp, rank, ep=1, **kw) -> dict:
    """Keys whose bytes depend on what torch.empty* held (two loads, fill 0xA5 and 0x5A)."""
    a = default_load(src, tp, rank, ep, fill=0xA5, **kw)
    ax = dict(EXTRAS)
    b = default_load(src, tp, rank, ep, fill=0x5A, **kw)
    out = {}
    for k in a:
        x, y = a[k].contiguous().reshape(-1).view(torch.uint8), b[k].contiguous().reshape(-1).view(torch.uint8)
        if x.numel() != y.numel() or int((x != y).sum()):
            out[k] = int((x != y).sum()) if x.numel() == y.numel() else -1
    for k in ax:
        x, y = ax[k].contiguous().reshape(-1).view(torch.uint8), EXTRAS[k].contiguous().reshape(-1).view(torch.uint8)
        if int((x != y).sum()):
            out["EXTRA " + k] = int((x != y).sum())
    return out



# ---------------------------------------------------------------- bytes vs the checkpoint and aiter's functions

class _Src:
    def __init__(self, src):
        from safetensors import safe_open

        self.h = {}
        for f in sorted(pathlib.Path(src).glob("*.safetensors")):
            h = safe_open(str(f), "pt")
            for k in h.keys():
                self.h[k] = h

    def __contains__(self, k):
        return k in self.h

    def __getitem__(self, k):
        return self.h[k].get_tensor(k)


def _rows(t, tp, r):
    n = t.shape[0] // tp
    return t[r * n:(r + 1) * n]


def _cols(t, tp, r):
    n = t.shape[-1] // tp
    return t[..., r * n:(r + 1) * n]


def _pad_rows(t, n):
    return t if t.shape[-2] == n else torch.cat([t, t.new_zeros(*t.shape[:-2], n - t.shape[-2], t.shape[-1])], -2)


def expected_raw(src: _Src, vname: str, tp: int, rank: int, cfg: dict, ep: int = 1):
    """The checkpoint's bytes for vLLM module VNAME on RANK, before any processing, in vLLM's
    merge/split order: (weight, scale) for MXFP4 modules, or None where no rule applies."""
    col = ("q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
    rowk = ("o_proj", "down_proj")
    m = re.match(r"(.*)\.(fused_qkv_a_proj|gate_up_proj|q_b_proj|kv_b_proj|o_proj|down_proj)$", vname)
    if m:
        base, mod = m.groups()
        parts = {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(
            mod, [mod])
        base = base.replace(".experts._shared_experts._layer", ".shared_experts")
        ws, ss = [], []
        for p in parts:
            k = f"{base}.{p}.weight"
            if k not in src or f"{base}.{p}.weight_scale" not in src:
                return None
            w, sc = src[k], src[f"{base}.{p}.weight_scale"]
            if p in col:
                w, sc = _rows(w, tp, rank), _rows(sc, tp, rank)
            elif p in rowk:
                w, sc = _cols(w, tp, rank), _cols(sc, tp, rank)
            ws.append(w)
            ss.append(sc)
        return torch.cat(ws), torch.cat(ss)
    m = re.match(r"(.*)\.experts\.routed_experts$", vname)
    if m:
        base = m.group(1)
        n = cfg["n_routed_experts"]
        if ep > 1:
            per = n // ep
            ids = range(rank * per, (rank + 1) * per)
        else:
            ids = range(n)
        w13, s13, w2, s2 = [], [], [], []
        for e in ids:
            g = f"{base}.experts.{e}."
            if g + "gate_proj.weight" not in src:
                return None
            gw, gs, uw, us = (src[g + x] for x in ("gate_proj.weight", "gate_proj.weight_scale", "up_proj.weight",
                                                   "up_proj.weight_scale"))
            dw, ds = src[g + "down_proj.weight"], src[g + "down_proj.weight_scale"]
            if ep == 1:
                gw, gs, uw, us = (_rows(x, tp, rank) for x in (gw, gs, uw, us))
                dw, ds = _cols(dw, tp, rank), _cols(ds, tp, rank)
            w13.append(torch.cat([gw, uw]))
            s13.append(torch.cat([gs, us]))
            w2.append(dw)
            s2.append(ds)
        return torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2)
    return None


FILL_REPORT = 0xA5  # the fill byte of the load whose state dict is reported


def _eq(a, b) -> bool:
    a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def dense_layout(w, s, rw, rs) -> str:
    """Which layout vLLM's (w, s) are, given the checkpoint's rank bytes (rw, rs)."""
    from aiter.ops.shuffle import shuffle_weight
    from aiter.utility.fp4_utils import e8m0_shuffle

    if _eq(w, rw) and _eq(s, rs):
        return "raw weight, raw scale [N, K/32]"
    if _eq(w, rw) and _eq(s, rs.t()):
        return "raw weight [N, K/2]; scale transposed [K/32, N] (== checkpoint scale .T)"
    if _eq(w, shuffle_weight(rw, layout=(16, 16))):
        es = e8m0_shuffle(rs).contiguous().view(torch.uint8).reshape(-1)[: rs.numel()]
        sl = "scale == aiter e8m0_shuffle(scale) (first N rows, unpadded)" if torch.equal(
            s.contiguous().view(torch.uint8).reshape(-1), es) else "scale: UNKNOWN permutation"
        return f"weight == aiter shuffle_weight(w, (16,16)) (W16); {sl}; shape {list(s.shape)}"
    return "UNKNOWN"


def moe_layout(mod_sd: dict, raw) -> dict:
    from aiter.ops.shuffle import shuffle_weight
    from aiter.utility.fp4_utils import e8m0_shuffle

    rw13, rs13, rw2, rs2 = raw
    out = {}
    for name, got, rw, rs in (("w13", mod_sd["w13_weight"], rw13, None), ("w2", mod_sd["w2_weight"], rw2, None),
                              ("w13_scale", mod_sd["w13_weight_scale"], None, rs13),
                              ("w2_scale", mod_sd["w2_weight_scale"], None, rs2)):
        if rw is not None:
            # vLLM pads the intermediate with zeros (w13 rows per half, w2 K columns) before shuffling
            n_half = got.shape[1] // 2 if name == "w13" else None
            if name == "w13" and got.shape[1] != rw.shape[1]:
                h = rw.shape[1] // 2
                rw = torch.cat([_pad_rows(rw[:, :h], n_half), _pad_rows(rw[:, h:], n_half)], 1)
            if name == "w2" and got.shape[2] != rw.shape[2]:
                rw = torch.cat([rw, rw.new_zeros(*rw.shape[:2], got.shape[2] - rw.shape[2])], 2)
            ok_raw = _eq(got, rw)
            ok_sh = _eq(got, shuffle_weight(rw, layout=(16, 16)))
            out[name] = ("raw" if ok_raw else "") + ("aiter shuffle_weight(stacked [E, N, K/2], (16,16)) (W16 per expert)"
                                                     if ok_sh else "") or "UNKNOWN"
        else:
            e, n, k = rs.shape
            with on_cpu(FILL_REPORT):  # e8m0_shuffle pads into torch.empty memory: the load's fill byte
                sh = e8m0_shuffle(rs.reshape(e * n, k))
            ok = _eq(got.reshape(-1), sh.contiguous().view(torch.uint8).reshape(-1)[: got.numel()])
            pad = "" if got.shape == rs.shape else (
                f"; K/32 padded {k} -> {got.shape[-1]} by e8m0_shuffle (padding = uninitialised torch.empty bytes),"
                f" held 3-D {list(got.shape)}")
            out[name] = ("aiter e8m0_shuffle(scale.view(E*N, K/32)).view(E, N, -1)" + pad if ok else
                         ("raw" if _eq(got, rs) else "UNKNOWN"))
    return out


def layout_report(src, sd: dict, model, tp: int, rank: int, ep: int = 1) -> dict:
    cfg = json.loads((pathlib.Path(src) / "config.json").read_text())
    S = _Src(src)
    rep = {}
    al = aliases(model)
    for name, d in choices(model).items():
        if f"{name}.weight" in al or f"{name}.w13_weight" in al:
            continue
        raw = expected_raw(S, name, tp, rank, cfg, ep)
        if raw is None:
            continue
        if d.get("mxfp4_backend"):
            msd = {k.rsplit(".", 1)[1]: v for k, v in sd.items() if k.rsplit(".", 1)[0] == name}
            rep[name] = {**d, "layout": moe_layout(msd, raw),
                         "shapes": {k: list(v.shape) for k, v in msd.items()},
                         "checkpoint_rank_shapes": [list(x.shape) for x in raw]}
        elif f"{name}.weight_scale" in sd:
            w, s_ = sd[f"{name}.weight"], sd[f"{name}.weight_scale"]
            rep[name] = {**d, "N,K": [w.shape[0], w.shape[1] * 2],
                         "layout": dense_layout(w, s_, *raw), "weight": list(w.shape), "scale": list(s_.shape)}
    return rep



def origin(key: str, ckpt: set) -> str:
    """'ckpt' if KEY (or its source parts) is read from the checkpoint, else 'not in checkpoint'."""
    m = key.rsplit(".", 1)
    base, leaf = m[0], m[1]
    base = base.replace(".experts._shared_experts._layer", ".shared_experts").replace(".experts.gate", ".gate")
    base = base.replace(".self_attn.mla_attn.mla_attn.", ".self_attn.").replace(".self_attn.mla_attn.", ".self_attn.")
    cands = [f"{base}.{leaf}"]
    for fused, parts in (("fused_qkv_a_proj", ["q_a_proj"]), ("gate_up_proj", ["gate_proj"])):
        if base.endswith(fused):
            cands += [f"{base[:-len(fused)]}{p}.{leaf}" for p in parts]
    if ".experts.routed_experts" in base:
        b = base.replace(".experts.routed_experts", "")
        proj = "down_proj" if leaf.startswith("w2") else "gate_proj"
        lf = "weight_scale" if leaf.endswith("_scale") else "weight"
        cands += [f"{b}.experts.0.{proj}.{lf}", f"{b}.gate.{leaf}"]
    return "ckpt" if any(c in ckpt for c in cands) else "NOT in checkpoint"


def tuned_shapes(shapes: dict) -> dict:
    """vLLM's own two probes (rocm_aiter_ops.is_asm_fp4_gemm_tuned, is_triton_gemm_afp4wfp4_presh_ws_tuned,
    on aiter e4048607's real lookup code and tables) for named (N, K) shapes."""
    install()
    from vllm._aiter_ops import rocm_aiter_ops

    out = {}
    for name, (n, k) in shapes.items():
        a = rocm_aiter_ops.is_asm_fp4_gemm_tuned(n, k // 2)
        t = rocm_aiter_ops.is_triton_gemm_afp4wfp4_presh_ws_tuned(n, k // 2)
        out[name] = {"N": n, "K": k, "asm_tuned": a, "triton_presh_tuned": t,
                     "scale_ok": n % 32 == 0 and (k // 32) % 8 == 0,
                     "layout": "W16 + permuted scale" if a and t and n % 32 == 0 and (k // 32) % 8 == 0
                     else "raw + scale.T"}
    return out


def r1_shapes(tp: int) -> dict:
    """DeepSeek-R1's MXFP4 dense linears per TP rank (attention is BF16 in amd/DeepSeek-R1-0528-MXFP4;
    listed too, for a checkpoint that quantizes it)."""
    h, inter, mi, ql, kl, nh, qk, v = 7168, 18432, 2048, 1536, 512, 128, 192, 128
    return {"fused_qkv_a_proj": (ql + kl + 64, h), "q_b_proj": (nh * qk // tp, ql),
            "kv_b_proj": (nh * (128 + v) // tp, kl), "o_proj": (h, nh * v // tp),
            "mlp.gate_up_proj (dense)": (2 * inter // tp, h), "mlp.down_proj (dense)": (h, inter // tp),
            "shared_experts.gate_up_proj": (2 * mi // tp, h), "shared_experts.down_proj": (h, mi // tp)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("default-load", help="DefaultModelLoader on SRC as TP rank RANK: keys, layouts")
    p.add_argument("src")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--unset", action="store_true", help="load twice (fill 0xA5 / 0x5A) to find unset bytes")
    p.add_argument("--force-asm-tuned", action="store_true",
                   help="answer vLLM's tuned-shape probes True for every shape (shows the ASM branch's bytes)")
    p.add_argument("--fuse-shared", action="store_true", help="VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1")
    p.add_argument("--out", help="JSON report")
    p = sub.add_parser("tuned-shapes", help="vLLM's tuned-shape probes for R1's dense MXFP4 linears")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    a = ap.parse_args(argv)
    if a.cmd == "tuned-shapes":
        for tp in a.tp:
            for k, v in tuned_shapes(r1_shapes(tp)).items():
                print(f"tp{tp} {k:30s} N={v['N']:6d} K={v['K']:6d} asm_tuned={v['asm_tuned']!s:5s} "
                      f"triton_presh_tuned={v['triton_presh_tuned']!s:5s} -> {v['layout']}")
        return 0
    if a.fuse_shared:
        os.environ["VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS"] = "1"
    install()
    if a.force_asm_tuned:
        force_asm_tuned()
    t0 = time.time()
    folder, rewritten = config_copy(a.src)
    sd = default_load(a.src, a.tp, a.rank, a.ep)
    t1 = time.time()
    model = MODEL["model"]
    al = aliases(model)
    ck = loaded_from_checkpoint(a.src)
    unset = unset_bytes(a.src, a.tp, a.rank, a.ep) if a.unset else {}
    model = MODEL["model"]
    print(f"# {a.src} TP {a.tp} rank {a.rank} EP {a.ep}; excludes rewritten as re: {rewritten}")
    for k, v in sd.items():
        tag = f"alias of {al[k]}" if k in al else origin(k, ck)
        print(f"{k:72s} {str(v.dtype).replace('torch.', ''):14s} {str(list(v.shape)):16s} {tag}"
              + (f" UNSET {unset[k]}B" if k in unset else ""))
    for k, v in EXTRAS.items():
        print(f"EXTRA {k:66s} {str(v.dtype).replace('torch.', ''):14s} {list(v.shape)}"
              + (f" UNSET {unset['EXTRA ' + k]}B" if 'EXTRA ' + k in unset else ""))
    lr = layout_report(folder, sd, model, a.tp, a.rank, a.ep)
    for k, v in lr.items():
        print("LAYOUT", k, json.dumps(v))
    calls = {}
    for c in CALLS:
        calls[c] = calls.get(c, 0) + 1
    uniq = [k for k in sd if k not in al]
    print(f"{len(sd)} state-dict keys ({len(uniq)} distinct tensors, {len(al)} aliases), "
          f"{sum(sd[k].numel() * sd[k].element_size() for k in uniq)} bytes; {len(EXTRAS)} extras; "
          f"load {t1 - t0:.1f} s; unset: {'not checked' if not a.unset else (unset or 'none')}")
    print("stand-in calls:", calls)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps({
            "src": a.src, "tp": a.tp, "rank": a.rank, "ep": a.ep, "excludes_rewritten": rewritten,
            "keys": [{"key": k, "dtype": str(v.dtype), "shape": list(v.shape), "alias_of": al.get(k),
                      "origin": origin(k, ck), "unset_bytes": unset.get(k, 0)} for k, v in sd.items()],
            "extras": {k: [str(v.dtype), list(v.shape)] for k, v in EXTRAS.items()},
            "choices": choices(model), "layouts": lr, "stand_in_calls": calls, "load_s": round(t1 - t0, 2)},
            indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
