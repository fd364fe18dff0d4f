"""Device timing for the GPU benchmarks (fused-quant, fused-fp8-quant, gemm).

One home for the CUDA-graph timing loop: calls captured in one graph and replayed, so that the
time is the device's, without Python or launch overhead. On the CPU (the benchmarks' smoke runs
under TRITON_INTERPRET=1) every helper returns the wall-clock time of one call instead.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence, Union

import torch

Calls = Union[Callable[[], object], Sequence[Callable[[], object]]]


def events_ms(fn: Callable[[], object], n: int) -> float:
    """Milliseconds of ``n`` back-to-back calls of ``fn``, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def wall_us(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def _as_list(fns: Calls) -> list:
    return list(fns) if isinstance(fns, (list, tuple)) else [fns]


def time_eager_us(fn: Callable[[], object], budget_ms: float, cpu: bool = False) -> float:
    """Median per-call time of back-to-back eager calls (launch overhead included)."""
    if cpu:
        return wall_us(fn)
    fn()
    torch.cuda.synchronize()
    one = max(events_ms(fn, 3) / 3, 1e-3)
    n = int(min(200, max(3, budget_ms / 5 / one)))
    return statistics.median(events_ms(fn, n) / n for _ in range(5)) * 1e3


def time_graph_us(fns: Calls, budget_ms: float, cpu: bool = False, max_calls: int = 200,
                  max_replays: int = 50) -> float:
    """Median per-call device time of a CUDA graph that calls ``fns`` (one callable, or several
    called in turn: e.g. one per weight copy, to rotate past the L2) ~2 ms of work per replay,
    replayed for about ``budget_ms``."""
    fns = _as_list(fns)
    if cpu:
        return wall_us(fns[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles, autotunes) off the capture
        for _ in range(3 if len(fns) == 1 else 1):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    one = max(events_ms(lambda: [fn() for fn in fns], 2) / (2 * len(fns)), 1e-3)
    rounds = int(min(max(1, max_calls // len(fns)), max(1, 2.0 / (one * len(fns)))))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for fn in fns:
                fn()
    g.replay()
    torch.cuda.synchronize()
    calls = rounds * len(fns)
    replays = int(min(max_replays, max(5, budget_ms / (calls * one))))
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del g
    return statistics.median(times) * 1e3
