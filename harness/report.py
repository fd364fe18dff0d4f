"""The one output format of the engine checks: a header, one row per rank with the same columns for
every engine (each row's problems and notes indented under it), and a verdict line.

    engine    rank  tensors  draft  derived  bytes_equal  unwritten  warned  result
    vllm       1/2      143     39        -      7803088          -       -  ok
        dense linears by vLLM's GEMM: MXFP4 Triton GEMM (raw) 6
    ok: every rank checked (1) equals the engine's own load

Columns (``-``: what this engine's check does not measure):

* ``engine``: the engine, or the configuration of ``check-atom-matrix`` (it may hold spaces);
* ``rank``: rank/TP;
* ``tensors``: the state-dict tensors compared (parameters and buffers; the MTP draft's among them);
* ``draft``: of them, the MTP draft model's (``-``: no draft loaded);
* ``derived``: tensors the engine derives at load and holds beside its state dict (MLA's W_K/W_V
  and scales), compared too;
* ``bytes_equal``: the bytes found equal (on a row that is ``ok``, every byte compared);
* ``unwritten``: bytes the engine's own load never writes (two loads with ``torch.empty`` filled
  differently tell them), compared nowhere. SGLang's and vLLM's checks fill the two sides
  differently instead: there such a byte is a difference;
* ``warned``: the engine's "NOT loaded" warning on the door's side: ``no``, ``same`` (as on its
  own load of the source), ``yes`` (a failure);
* ``result``: ``ok`` or ``FAIL``.
"""

from __future__ import annotations

import dataclasses

COLUMNS = ("engine", "rank", "tensors", "draft", "derived", "bytes_equal", "unwritten", "warned", "result")
_WIDTHS = (5, 8, 6, 8, 12, 10, 7)  # of the columns after the first
ENGINE_WIDTH = 8
PROBLEMS_SHOWN = 10  # a row's first problems; the rest are counted


class Failure(str):
    """A line a check yields that fails it beside the ranks' rows (a start-up that failed, say)."""


@dataclasses.dataclass
class RankResult:
    """One rank's comparison of the engine's load of the converted folder with its own load of the
    source (module docstring: the columns)."""

    engine: str
    rank: int
    tp: int
    tensors: int
    bytes_equal: int
    draft: int | None = None
    derived: int | None = None
    unwritten: int | None = None
    warned: str | None = None
    problems: list[str] = dataclasses.field(default_factory=list)  # each a failure
    notes: list[str] = dataclasses.field(default_factory=list)  # said, not failures

    @property
    def ok(self) -> bool:
        return not self.problems and self.warned != "yes"

    def lines(self, width: int = ENGINE_WIDTH) -> list[str]:
        """The row (its first column ``width`` wide), then its problems and notes, indented."""
        cells = [f"{self.rank}/{self.tp}", self.tensors, self.draft, self.derived, self.bytes_equal, self.unwritten,
                 self.warned]
        row = f"{self.engine:<{width}} " + " ".join(f"{'-' if c is None else c:>{w}}" for c, w in zip(cells, _WIDTHS))
        shown = self.problems[:PROBLEMS_SHOWN]
        more = len(self.problems) - len(shown)
        return ([f"{row}  {'ok' if self.ok else 'FAIL'}"] + [f"    {p}" for p in shown]
                + ([f"    ... and {more} more"] if more > 0 else []) + [f"    {n}" for n in self.notes])


def header(width: int = ENGINE_WIDTH) -> str:
    return f"{COLUMNS[0]:<{width}} " + " ".join(f"{c:>{w}}" for c, w in zip(COLUMNS[1:], _WIDTHS)) + \
        f"  {COLUMNS[-1]}"


def verdict(results: list[RankResult], failures: list[str] = ()) -> str:
    """The last line: ``ok: ...`` only when every rank matched and nothing else failed
    (``failures``: one line each, printed before it)."""
    bad = sum(not r.ok for r in results)
    if not results and not failures:
        return "FAIL: no rank was checked"
    if bad or failures:
        return f"FAIL: {bad} of {len(results)} ranks differ from the engine's own load" + \
            (f"; {len(failures)} other failures" if failures else "")
    return f"ok: every rank checked ({len(results)}) equals the engine's own load"


def rows(text: str) -> list[dict[str, str]]:
    """The rows of a check's output, each by column name (for the tests and the scripts that
    read it): lines ending in ``ok`` / ``FAIL``, not indented, with the table's columns."""
    out = []
    for line in text.splitlines():
        words = line.split()
        if line[:1].isspace() or len(words) < len(COLUMNS) or words[-1] not in ("ok", "FAIL") or ":" in line:
            continue
        tail = words[-(len(COLUMNS) - 1):]
        out.append(dict(zip(COLUMNS, [" ".join(words[:-(len(COLUMNS) - 1)]), *tail])))
    return out
