"""Wall-clock timing of candidates against a baseline, alternated in the same run.

These machines are noisy (a shared disk, two shared cores): a number means something only
against the baseline measured beside it. So every benchmark runs its candidates in rounds, each
round every candidate once (or a short burst), and compares within the run.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping


@dataclasses.dataclass
class Timed:
    """What a candidate that times itself returns (a child process's own clock, which leaves out
    its start-up), with whatever else it measured (peak RSS, bytes read)."""

    seconds: float
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Runs:
    """Per candidate, in the order given: the seconds of each timed call, and the ``info`` of
    each call that returned :class:`Timed`."""

    seconds: dict[str, list[float]]
    info: dict[str, list[dict]]


def alternate(candidates: Mapping[str, Callable[[], object]], rounds: int, *, warmup: int = 0,
              burst: int = 1, warm_each: bool = False, rotate: bool = False,
              before: Callable[[str], None] | None = None, drop_failed: bool = False,
              on_round: Callable[[int, dict[str, float]], None] | None = None,
              clock: Callable[[], float] = time.perf_counter) -> Runs:
    """Run ``candidates`` round-robin: ``warmup`` untimed rounds, then ``rounds`` timed ones.

    ``burst``: timed calls per candidate per round, after one untimed call if ``warm_each`` (warm
    caches for each, while drift still hits all alike). ``rotate``: the order turns by one each
    round, so that no candidate always runs first after what ``before`` does (untimed, before
    every call: evict the page cache, delete the last output). ``drop_failed``: a candidate that
    raises is reported and left out of the rounds after (a comparison that cannot run here);
    otherwise the error propagates. ``on_round(i, seconds)`` sees each timed round as it ends.
    """
    live = dict(candidates)
    runs = Runs({name: [] for name in live}, {name: [] for name in live})
    for r in range(warmup + rounds):
        names = list(live)
        if rotate:
            names = names[r % len(names):] + names[:r % len(names)]
        this_round = {}
        for name in names:
            try:
                if warm_each:
                    live[name]()
                for _ in range(burst):
                    if before is not None:
                        before(name)
                    t0 = clock()
                    got = live[name]()
                    seconds = clock() - t0
                    own = got if isinstance(got, Timed) else None
                    del got  # what the call returned (a loaded rank) is freed before the next call
                    if own is not None:
                        seconds = own.seconds
                    if r >= warmup:
                        runs.seconds[name].append(seconds)
                        if own is not None:
                            runs.info[name].append(own.info)
                        this_round[name] = seconds
            except Exception as exc:
                if not drop_failed:
                    raise
                first = str(exc).splitlines()[0] if str(exc) else ""
                print(f"  {name}: failed: {type(exc).__name__}: {first}", flush=True)
                del live[name]
        if on_round is not None and r >= warmup:
            on_round(r - warmup, this_round)
    return runs
