"""The one error type the CLI turns into a one-line message and exit code 1."""


class PrepError(Exception):
    """Bad input or a failed step, with a message that names the file/tensor and what to do."""
