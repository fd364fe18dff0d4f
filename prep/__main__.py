"""``python -m prep``: the same command as ``prep``."""

from .cli import run

run()
