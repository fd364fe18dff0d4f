"""The one table every benchmark prints: candidate, time, ratio to the baseline of the same run.

A row is one candidate (in one case: a shape, a TP size) with all its timed samples; the ratio
is always the baseline's over the candidate's, so > 1 means faster (or, for memory, smaller)
than the baseline, whichever benchmark printed it.
"""

from __future__ import annotations

import dataclasses
import statistics

GiB = 1 << 30


@dataclasses.dataclass
class _Row:
    case: str
    candidate: str
    values: list[float]
    nbytes: int | None
    notes: dict[str, str]


class Table:
    """Rows added with :meth:`add`, printed aligned by :meth:`print`.

    ``baseline``: the candidate every row of the same case is compared with (None: no ratio
    column, for a benchmark whose baseline is another run, as ``build``'s other tree);
    ``also_against``: more candidates to compare with, a ratio column each (convert: cp -r and
    cp -r; sync). ``stat``: "best" (the
    least of each row's samples, and the ratio of those) or "median" (the median, and the median
    of the per-round ratios: rounds alternate, so a round's samples ran side by side; with
    unequal sample counts, the ratio of the medians). ``what``: "time" (seconds; GB/s where a row
    gives the bytes it moved) or "memory" (bytes, the peak of the samples).
    """

    def __init__(self, baseline: str | None, *, title: str = "", stat: str = "best", what: str = "time",
                 also_against: tuple[str, ...] = ()):
        assert stat in ("best", "median") and what in ("time", "memory")
        self.baseline, self.title, self.stat, self.what = baseline, title, stat, what
        self.against = [baseline, *also_against] if baseline else []
        self.rows: list[_Row] = []

    def add(self, candidate: str, values, *, case: str = "", nbytes: int | None = None, **notes) -> None:
        """``values``: the candidate's samples (seconds, or bytes for memory); ``notes``: more
        columns, printed as given (``peak_rss="1.2 GiB"``; underscores print as spaces)."""
        values = [values] if isinstance(values, (int, float)) else list(values)
        self.rows.append(_Row(case, candidate, values, nbytes, {k: str(v) for k, v in notes.items()}))

    def _headline(self, values: list[float]) -> float:
        if self.what == "memory":
            return max(values)
        return min(values) if self.stat == "best" else statistics.median(values)

    def _ratio(self, row: _Row, base: _Row | None) -> float | None:
        if base is None or not row.values or not base.values:
            return None
        if self.what == "time" and self.stat == "median" and len(row.values) == len(base.values):
            return statistics.median(b / v for b, v in zip(base.values, row.values))
        return self._headline(base.values) / self._headline(row.values)

    def _scale(self) -> tuple[str, float]:
        if self.what == "memory":
            return "GiB", GiB
        least = min((min(r.values) for r in self.rows if r.values), default=1.0)
        return ("s", 1.0) if least >= 1 else ("ms", 1e-3) if least >= 1e-3 else ("us", 1e-6)

    def print(self) -> None:
        unit, scale = self._scale()
        cases = any(r.case for r in self.rows)
        both = self.what == "time" and any(len(r.values) > 1 for r in self.rows)
        rates = any(r.nbytes for r in self.rows)
        notes = list(dict.fromkeys(k for r in self.rows for k in r.notes))
        head = (["case"] if cases else []) + ["candidate"]
        head += [f"best {unit}", f"median {unit}"] if both else [f"{'peak' if self.what == 'memory' else 'time'} {unit}"]
        head += [f"x {b}" if len(b) <= 14 else "x baseline" for b in self.against] + (["GB/s"] if rates else []) + [k.replace("_", " ") for k in notes]
        body = []
        for row in self.rows:
            cells = ([row.case] if cases else []) + [row.candidate]
            if not row.values:
                cells += ["-"] * (2 if both else 1)
            elif both:
                cells += [f"{min(row.values) / scale:.3f}", f"{statistics.median(row.values) / scale:.3f}"]
            else:
                cells += [f"{self._headline(row.values) / scale:.3f}"]
            for name in self.against:
                base = next((b for b in self.rows if b.case == row.case and b.candidate == name), None)
                ratio = self._ratio(row, base)
                cells.append("baseline" if row is base else f"{ratio:.2f}x" if ratio is not None else "-")
            if rates:
                seconds = self._headline(row.values) if row.values else 0
                cells.append(f"{row.nbytes / seconds / 1e9:.2f}" if row.nbytes and seconds else "-")
            cells += [row.notes.get(k, "") for k in notes]
            body.append(cells)
        widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
        text = len(head) - len(notes)  # case and candidate left-aligned, numbers right, notes left

        def line(cells: list[str]) -> str:
            out = []
            for i, (c, w) in enumerate(zip(cells, widths)):
                left = i < (2 if cases else 1) or i >= text
                out.append(f"{c:<{w}}" if left else f"{c:>{w}}")
            return "  ".join(out).rstrip()

        if self.title:
            print(self.title)
        print(line(head))
        for cells in body:
            print(line(cells))
        if not self.baseline:
            return
        if self.what == "memory":
            how = "the baseline's peak / this one's (> 1: less memory)"
        elif self.stat == "median":
            how = "the median over rounds of the baseline's time / this one's (> 1: faster)"
        else:
            how = "the baseline's best time / this one's (> 1: faster)"
        print(f"x {', x '.join(self.against)}: {how}", flush=True)
