"""``python -m prep.cli``: the same as ``prep`` (and ``python -m prep``)."""

from . import run

run()
