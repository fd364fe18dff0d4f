"""The platform as one MI355X (gfx950) on a CPU, for the engine harnesses that build SGLang's and
vLLM's real models here (:mod:`harness.sglang`, :mod:`harness.vllm`): ``torch.version.hip``
set and ``torch.cuda`` answering as that device, ``device="cuda"`` mapped to the CPU with every
``torch.empty*`` filled with one byte (memory that loading never writes is then visible: two
loads with different bytes differ exactly there), and triton's active driver answering "hip
gfx950" (engines ask at import; nothing is compiled or launched here)."""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

from harness.stand_ins import CALLS, StandIn

ARCH = {"name": "gfx950"}


def device_props(*_a, **_k) -> types.SimpleNamespace:
    """``torch.cuda.get_device_properties`` of one MI355X."""
    return types.SimpleNamespace(
        name="AMD Instinct MI355X", gcnArchName=f"{ARCH['name']}:sramecc+:xnack-", major=9, minor=5,
        total_memory=288 << 30, multi_processor_count=256, warp_size=64, L2_cache_size=4 << 20, is_integrated=False,
        uuid="00000000-0000-0000-0000-000000000000", regs_per_multiprocessor=65536,
        max_threads_per_multi_processor=2048, shared_memory_per_block_optin=160 << 10)


class NoStream:
    """``torch.cuda.Stream`` / ``Event``: usable as a context; anything else is a stand-in."""

    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def __getattr__(self, name):
        return StandIn(f"torch.cuda.Stream.{name}")


def patch_torch() -> None:
    """``torch.version.hip`` and ``torch.cuda`` as one MI355X (module docstring)."""
    torch.version.hip = "7.0.51831-a3e329ad8"
    c = torch.cuda
    c.is_available = lambda: True
    c.device_count = lambda: 8
    c.current_device = lambda: 0
    c.set_device = lambda *a, **k: None
    c.get_device_properties = device_props
    c.get_device_capability = lambda *a, **k: (9, 5)
    c.get_device_name = lambda *a, **k: "AMD Instinct MI355X"
    c.synchronize = lambda *a, **k: None
    c.empty_cache = lambda *a, **k: None
    c.max_memory_allocated = lambda *a, **k: 0
    c.memory_allocated = lambda *a, **k: 0
    c.memory_reserved = lambda *a, **k: 0
    c.reset_peak_memory_stats = lambda *a, **k: None
    c.mem_get_info = lambda *a, **k: (200 << 30, 288 << 30)
    c.Stream = c.Event = NoStream
    c.current_stream = c.default_stream = lambda *a, **k: NoStream()
    c.stream = lambda *a, **k: contextlib.nullcontext()
    c.is_current_stream_capturing = lambda: False
    c.get_rng_state = lambda *a, **k: torch.get_rng_state()
    c.manual_seed = c.manual_seed_all = lambda *a, **k: None
    c.is_initialized = lambda: True
    c._lazy_init = lambda: None


def _on_cpu(d):
    if isinstance(d, torch.device) and d.type == "cuda" or isinstance(d, str) and d.startswith("cuda"):
        return torch.device("cpu")
    return torch.device("cpu") if isinstance(d, int) and not isinstance(d, bool) else d


_EMPTY = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}


class CpuMode(TorchFunctionMode):
    """``device="cuda"`` -> cpu; pinned memory is plain memory; ``torch.empty*`` memory is filled
    with ``fill``."""

    def __init__(self, fill: int):
        super().__init__()
        self.fill = fill

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_on_cpu(a) for a in args)
        out = func(*args, **kwargs)
        if func in _EMPTY and isinstance(out, torch.Tensor) and out.dim() and out.is_contiguous():
            out.view(torch.uint8).fill_(self.fill)
        return out


@contextlib.contextmanager
def on_cpu(fill: int = 0xA5) -> Iterator[None]:
    """Build and load on the CPU, ``torch.empty*`` memory holding byte ``fill``."""
    with CpuMode(fill):
        yield


class TritonHipDriver:
    """``triton.runtime.driver.active``: answers "hip gfx950"; nothing launches here."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("hip", ARCH["name"], 64)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def get_current_stream(self, *a):
        CALLS.append("triton.driver.get_current_stream")
        return 0

    def __getattr__(self, name):
        return StandIn(f"triton.runtime.driver.active.{name}")
