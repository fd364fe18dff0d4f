"""The ``prep`` command line: inspect, convert, verify, revert, run, compare.

Every command turns a :class:`PrepError` into one line on stderr and exit code 1; ``--json``
prints the result as one JSON object for scripts. One module a part: the frame (``app``: the
group, errors, shared options, the entry point), the verbs on checkpoints, the reference engine's.
"""

from __future__ import annotations

from .app import DEFAULT_ENGINE, error_line, main, run
from .checkpoints import convert, default_out, inspect, revert, verify  # registers the verbs with main
from .reference import compare, run_cmd

__all__ = ["DEFAULT_ENGINE", "compare", "convert", "default_out", "error_line", "inspect", "main", "revert", "run",
           "run_cmd", "verify"]
