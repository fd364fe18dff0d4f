"""``python -m prep``: the same command as ``prep``."""

from .cli import main

main(prog_name="prep")
