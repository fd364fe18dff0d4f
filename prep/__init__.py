"""prep: the offline converter (CLI, checkpoint I/O, conversion pipeline)."""
