"""The one error type the CLI turns into a one-line message and exit code 1."""


class PrepError(Exception):
    """Bad input or a failed step, with a message that names the file/tensor and what to do.
    ``result``: what the step measured before it failed (``--json`` prints it in the one error
    object, e.g. compare's differences)."""

    def __init__(self, message: str, result: dict | None = None):
        super().__init__(message)
        self.result = result
