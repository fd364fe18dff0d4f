"""prep: the offline converter (CLI, checkpoint I/O, conversion pipeline)."""

__version__ = "0.1.0"
