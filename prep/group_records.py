"""A group rebuilt from its manifest record, whichever its kind: a dense linear or a MoE layer
(``prep.groups``), or a rank's BF16 tensor (``prep.bf16``). What reading a converted checkpoint
back (verify, revert, the reference engine) starts from; its own module because it needs both
group modules, and ``prep.bf16`` builds on ``prep.groups``."""

from __future__ import annotations

import layouts
from layouts.manifest import GroupRecord

from . import bf16
from .errors import PrepError
from .groups import LayoutOf, LinearGroup, MoEGroup, Part


def group_from_record(rec: GroupRecord, layout_of: LayoutOf = layouts.get_layout
                      ) -> "LinearGroup | MoEGroup | bf16.Bf16Group":
    """Rebuild a group from its manifest record, by its kind, holding its layout as ``layout_of``
    gives it (resolved here, once: the group's methods use the object)."""
    if rec.kind == "bf16":
        return bf16.group_from_record(rec, layout_of)
    if rec.kind == "linear":
        return LinearGroup(rec.name, rec.rank, rec.tp, tuple(Part(p.src, p.n, p.k, p.split) for p in rec.parts),
                           layout_of(rec.layout))
    if rec.kind == "moe":
        return MoEGroup(rec.name, rec.rank, rec.tp, tuple(rec.experts), rec.inter, rec.hidden, layout_of(rec.layout),
                        rec.inter_pad_to, rec.hidden_pad_to, rec.ep, rec.routed)
    raise PrepError(f"manifest: unknown group kind {rec.kind!r}")
