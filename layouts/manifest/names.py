"""Source tensor names as the manifest writes them: a run of experts as one pattern."""

from __future__ import annotations

import re
from typing import Any, Iterable


_LAST_INDEX = re.compile(r"^(.*\.)(\d+)(\..+)$")  # the last numeric path component: experts.<i>.
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def compress_names(names: Iterable[str]) -> list[str]:
    """Runs of names that differ only in their last numeric component, by consecutive integers,
    as one ``prefix{a..b}suffix`` pattern (``experts.{0..255}.gate_proj.weight``). Exact:
    :func:`expand_names` gives back the same list. A stacked MoE tensor's 257 sources stay one
    line, which keeps a TP 8 manifest of DeepSeek-R1 in megabytes rather than hundreds."""
    out: list[str] = []
    run: list[Any] | None = None  # [prefix, start, stop, suffix]

    def flush() -> None:
        if run is not None:
            p, a, b, sfx = run
            out.append(f"{p}{a}{sfx}" if b == a + 1 else f"{p}{{{a}..{b - 1}}}{sfx}")

    for name in names:
        m = _LAST_INDEX.match(name)
        if m and run is not None and (run[0], run[3]) == (m.group(1), m.group(3)) and run[2] == int(m.group(2)) \
                and m.group(2) == str(int(m.group(2))):
            run[2] += 1
            continue
        flush()
        run = [m.group(1), int(m.group(2)), int(m.group(2)) + 1, m.group(3)] \
            if m and m.group(2) == str(int(m.group(2))) else None
        if run is None:
            out.append(name)
    flush()
    return out


def expand_names(patterns: Iterable[str]) -> list[str]:
    """The inverse of :func:`compress_names`."""
    out: list[str] = []
    for p in patterns:
        m = _RANGE.search(p)
        if m is None:
            out.append(p)
        else:
            out += [f"{p[:m.start()]}{i}{p[m.end():]}" for i in range(int(m.group(1)), int(m.group(2)) + 1)]
    return out
