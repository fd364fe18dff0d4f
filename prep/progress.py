"""Progress of the long verbs on stderr: a tqdm bar on a terminal, and where there is none (a log
file, ``nohup``, CI) one plain line every ``PREP_PROGRESS_SECONDS`` seconds (10 by default):

    convert: 12.4 of 54.1 GiB (23%), 0.81 GiB/s, about 52 s left

The rate and the time left come from the last ``WINDOW`` seconds, not from the start: a verb's
steps differ in speed (``verify --source`` hashes at disk speed, then inverts and compares at a
fraction of it), and an average over everything done predicts the rest from the fast part."""

from __future__ import annotations

import collections
import os
import sys
import time

WINDOW = 30.0  # seconds of recent progress the rate is measured over


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("PREP_PROGRESS_SECONDS", "10")))
    except ValueError:
        return 10.0


def _amount(n: float, unit: str) -> str:
    return f"{n / 2**30:.1f}" if unit == "B" else f"{n:.0f}"


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """Called with each step's amount once ``total(n)`` said how much there is. ``mode``: "bar"
    (tqdm on a terminal), "log" (a line every interval) or None (silent)."""

    def __init__(self, desc: str, mode: str | None, unit: str = "B"):
        self.desc, self.mode, self.unit = desc, mode, unit
        self.bar = None
        self._total = 0
        self._done = 0
        self._start = self._last = 0.0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lines = 0

    @classmethod
    def shown(cls, desc: str, as_json: bool, quiet: bool, unit: str = "B") -> "Progress":
        """The bar on a terminal (not with --json: its reader may share the terminal), the log
        lines elsewhere (stdout keeps its one result either way), nothing with --quiet."""
        if quiet:
            return cls(desc, None, unit)
        if sys.stderr.isatty():
            return cls(desc, None if as_json else "bar", unit)
        return cls(desc, "log", unit)

    def total(self, n: int) -> None:
        self.close()
        self._total, self._done = n, 0
        self._start = self._last = time.monotonic()
        self._recent = collections.deque([(self._start, 0)])
        if self.mode == "bar":
            from tqdm import tqdm

            scaled = self.unit == "B"
            self.bar = tqdm(total=n, desc=self.desc, unit=self.unit, unit_scale=scaled,
                            unit_divisor=1024 if scaled else 1000, file=sys.stderr)

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)
            return
        if self.mode != "log" or not self._total:
            return
        self._done += n
        now = time.monotonic()
        self._recent.append((now, self._done))
        while len(self._recent) > 2 and self._recent[1][0] <= now - WINDOW:
            self._recent.popleft()
        if now - self._last >= _interval() and self._done < self._total:
            self._last = now
            self._line(now)

    def _line(self, now: float) -> None:
        t0, d0 = self._recent[0]
        rate = (self._done - d0) / (now - t0) if now > t0 else 0.0
        per = "GiB/s" if self.unit == "B" else f"{self.unit}/s"
        unit = " GiB" if self.unit == "B" else f" {self.unit}"
        left = f", about {_duration((self._total - self._done) / rate)} left" if rate > 0 else ""
        shown_rate = rate / 2**30 if self.unit == "B" else rate
        print(f"{self.desc}: {_amount(self._done, self.unit)} of {_amount(self._total, self.unit)}{unit} "
              f"({100 * self._done / self._total:.0f}%), {shown_rate:.2f} {per}{left}", file=sys.stderr, flush=True)
        self._lines += 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.mode == "log" and self._lines:  # a run long enough to have reported says how it ended
            took = time.monotonic() - self._start
            unit = " GiB" if self.unit == "B" else f" {self.unit}"
            print(f"{self.desc}: {_amount(self._done, self.unit)}{unit} in {_duration(took)}", file=sys.stderr,
                  flush=True)
        self._lines = 0
        self._total = 0
