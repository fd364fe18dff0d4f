"""The reference engine's dense MXFP4 GEMMs on aiter's kernels (``prep run --gemm aiter-triton``):
each module's product computed rank by rank on the bytes each rank stores, as an engine would.

For a converted checkpoint every dense linear group (``LinearGroup``: merged ``[q_a ; kv_a]``,
``[gate ; up]``, split by TP) runs on each rank's stored tensors (``layouts.load_rank``) through
:func:`prep.reference.aiter_gemm.mxfp4_gemm`; the module's output is put back together as tensor
parallelism does: column-parallel ranks' rows side by side, row-parallel ranks' partial sums
added in float32 in rank order (the all-reduce), a replicated module taken from its first rank.
A merged group's GEMM runs once for both of its modules (the model asks for them one after the
other with the same activation). A Quark source's dense linears are raw, the ``non-shuffle``
layout, and run whole.

MoE experts (the stacked groups, and a source's ``mlp.experts`` and ``mlp.shared_experts``,
which the default conversion stacks) are not handled here: the model computes them on its own
dequantize-and-matmul path.

Activations come in the layout of the GEMM path the kernel reads (``aiter_gemm.ACTIVATION_PATH``):
``(q, scale, flags)`` as the fused quant or :func:`lay_out_scale` gives them. A row-parallel
rank's slice of K is cut from the logical scale and laid out again the same way, which is
what that rank's own quantization of its slice would give (blocks of 32 never straddle ranks).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import types
from typing import Callable

import torch

import layouts
from layouts.selection import ActivationQuantFlags

from . import aiter_gemm
from ..errors import PrepError
from ..group_records import group_from_record
from ..groups import LinearGroup
from ..source import SourceCheckpoint

# Logits of the two dense GEMMs (torch, aiter-triton) agree within LOGIT_RTOL * max |logit|: one
# BF16 rounding step of the largest logit. Each GEMM output of either is within K * 2**-24 *
# (|A| @ |W|^T) of the exact sum of its (exact) MXFP4 products, so the two differ by at most
# 2 * K * 2**-24 of that (6.1e-5 relative for K = 512), 64 times below one BF16 step (2**-8); both
# are rounded to BF16 before the next module, so they agree there unless the exact value lies
# that close to a rounding boundary, where they differ by one step. docs/consumer-kernels.md.
LOGIT_RTOL = 2.0 ** -8

_MOE_SOURCE = re.compile(r"\.mlp\.(experts\.\d+|shared_experts)\.")


def lay_out_scale(s: torch.Tensor, flags: ActivationQuantFlags) -> torch.Tensor:
    """A raw ``[M, K/32]`` activation scale in the layout ``flags`` ask of the fused quant: as is,
    padded to ``[pad256(M), pad8(K/32)]``, or padded and S32x8-shuffled (pad bytes 0x7F, as the
    fused quant writes them)."""
    if flags.shuffle:
        return layouts.shuffle.preshuffle_scale(s, pad_value=layouts.mxfp4.E8M0_ONE)
    if flags.scale_shuffle_padding:
        m, cols = s.shape
        out = s.new_full(layouts.shuffle.shuffled_scale_shape(m, cols), layouts.mxfp4.E8M0_ONE)
        out[:m, :cols] = s
        return out
    return s


def logical_scale(s: torch.Tensor, m: int, cols: int, flags: ActivationQuantFlags) -> torch.Tensor:
    """The raw ``[m, cols]`` scale of an activation scale laid out by ``flags``."""
    if flags.shuffle:
        return layouts.shuffle.unshuffle_scale(s, m, cols)
    return s[:m, :cols] if flags.scale_shuffle_padding else s


@dataclasses.dataclass(frozen=True)
class Piece:
    """One rank's share of one source module: rows ``[row, row + n)`` of the group's GEMM output
    are the module's output rows ``rows``, computed from its input columns ``ks``."""

    group: str  # the stored tensors' prefix
    rank: int
    row: int
    n: int
    rows: slice
    ks: slice


class AiterDenseGemms:
    """``handles(prefix)``: whether the module is a dense MXFP4 linear computed here;
    ``gemm(prefix, q, scale, flags)``: its float32 ``[M, N]`` output."""

    def __init__(self, model_dir: str | pathlib.Path, manifest: layouts.Manifest | None = None, *,
                 assume_layout: str | None = None, device: str | torch.device = "cpu",
                 aiter_dir: str | pathlib.Path | None = None):
        self.root = pathlib.Path(model_dir)
        self.device = torch.device(device)
        self.kernels: types.ModuleType = aiter_gemm.gemm_module(aiter_dir, self.device)
        self.pieces: dict[str, list[Piece]] = {}
        self._groups: dict[tuple[str, int], tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], str, int, int]] = {}
        self._memo: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._on_device: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if manifest is not None:
            self._from_converted(manifest, assume_layout)
        else:
            self._from_source()
        self.layout = next(iter({lay for _, lay, _, _ in self._groups.values()}), aiter_gemm.NON_SHUFFLE)
        self.gemm_path = aiter_gemm.ACTIVATION_PATH.get(self.layout,
                                                        aiter_gemm.ACTIVATION_PATH[aiter_gemm.NON_SHUFFLE])

    def _from_converted(self, manifest: layouts.Manifest, assume_layout: str | None) -> None:
        ranks = [layouts.load_rank(self.root, r, manifest=manifest) for r in range(manifest.tp)]  # mapped
        for rec in manifest.groups:
            g = group_from_record(rec, manifest.recorded_layout)
            if not isinstance(g, LinearGroup):
                continue  # stacked experts: the model's own path
            layout = g.layout.name
            if assume_layout and layouts.get_layout(assume_layout).kind == g.layout.kind:
                layout = assume_layout  # read the bytes as another layout (to show a mismatch)
            (n, half_k), _ = g.local_shapes()
            problem = aiter_gemm.shape_problem(layout, n, 2 * half_k, f"{g.name}.weight (rank {g.rank})")
            if problem:  # refused before the forward starts, not halfway through it
                raise PrepError(problem)
            held = ranks[g.rank]
            read = lambda held=held, g=g: (held[f"{g.name}.weight"], held[f"{g.name}.weight_scale"])  # noqa: E731
            self._groups[g.name, g.rank] = (read, layout, n, 2 * half_k)
            row = 0
            for p in g.parts:
                pn = p.local(g.tp)[0]
                rows, ks = p.window(g.tp, g.rank)  # rows and K (value) columns of the source module
                piece = Piece(g.name, g.rank, row, pn, rows, ks)
                have = self.pieces.setdefault(p.src, [])
                # A replicated module is stored whole on every rank: its first rank computes it.
                if not any((q.rows, q.ks) == (piece.rows, piece.ks) for q in have):
                    have.append(piece)
                row += pn

    def _from_source(self) -> None:
        src = SourceCheckpoint(self.root)
        for name, info in src.tensors.items():
            prefix = name.removesuffix(".weight")
            if (not name.endswith(".weight") or info.dtype != "U8" or f"{prefix}.weight_scale" not in src.tensors
                    or _MOE_SOURCE.search(name + ".")):
                continue
            n, half_k = info.shape
            self._groups[prefix, 0] = (
                lambda prefix=prefix: (src.read(f"{prefix}.weight"), src.read(f"{prefix}.weight_scale")),
                aiter_gemm.NON_SHUFFLE, n, 2 * half_k)
            self.pieces[prefix] = [Piece(prefix, 0, 0, n, slice(0, n), slice(0, 2 * half_k))]

    def handles(self, prefix: str) -> bool:
        return prefix in self.pieces

    def _stored(self, key: tuple[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        read = self._groups[key][0]
        if self.device.type == "cpu":
            return read()
        if key not in self._on_device:  # dense weights only: a small part of a DeepSeek checkpoint
            self._on_device[key] = tuple(t.to(self.device) for t in read())
        return self._on_device[key]

    def _group_gemm(self, key: tuple[str, int], q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        # The modules of one merged group are asked for one after the other with the same
        # activation ([gate ; up]: quantized twice, to the same bytes): compute its GEMM once.
        hit = self._memo.get(key)
        if hit is not None and _same(hit[0], q) and _same(hit[1], s):
            return hit[2]
        _, layout, n, k = self._groups[key]
        w, ws = self._stored(key)
        y = aiter_gemm.mxfp4_gemm(self.kernels, q, s, w, ws, layout, n, k, name=f"{key[0]}.weight (rank {key[1]})")
        self._memo = {g: v for g, v in self._memo.items() if g[0] == key[0]}  # this group's ranks only
        self._memo[key] = (q, s, y)
        return y

    def gemm(self, prefix: str, q: torch.Tensor, s: torch.Tensor, flags: ActivationQuantFlags) -> torch.Tensor:
        """float32 ``x @ W.T`` of module ``prefix`` for the MXFP4 activation ``(q, s)`` whose scale
        is laid out as ``flags`` say, on every rank that holds a piece of the module."""
        m, k = q.shape[0], 2 * q.shape[1]
        pieces = self.pieces[prefix]
        n_out = max(p.rows.stop for p in pieces)
        y = torch.zeros((m, n_out), dtype=torch.float32, device=q.device)
        local: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for p in pieces:  # rank order: the partial sums of a row-parallel module add in that order
            ks = (p.ks.start, p.ks.stop)
            if ks not in local:
                if ks == (0, k):
                    local[ks] = (q, s)
                else:
                    raw = logical_scale(s, m, -(-k // 32), flags)[:, ks[0] // 32: ks[1] // 32].contiguous()
                    local[ks] = (q[:, ks[0] // 2: ks[1] // 2].contiguous(), lay_out_scale(raw, flags))
            out = self._group_gemm((p.group, p.rank), *local[ks])
            y[:, p.rows] += out[:, p.row: p.row + p.n].to(y.device)
        return y

    __call__ = gemm


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b)))


def kernel_gemm_path(manifest: layouts.Manifest | None, assume_layout: str | None = None) -> str:
    """The GEMM path whose activation flags aiter's kernel for this checkpoint's dense layout reads."""
    layout = aiter_gemm.NON_SHUFFLE if manifest is None else manifest.layout
    if assume_layout and layouts.get_layout(assume_layout).kind == "dense":
        layout = assume_layout
    if layout not in aiter_gemm.ACTIVATION_PATH:
        raise PrepError(f"--gemm aiter-triton: aiter's Triton GEMMs read the {', '.join(aiter_gemm.KERNELS)} "
                        f"layouts, not {layout!r}; run with --gemm torch")
    return aiter_gemm.ACTIVATION_PATH[layout]
