"""The one error base of the runtime library.

Every error ``layouts`` raises for bad input (a damaged file, a manifest it cannot read, a shape a
layout cannot take, an engine that would misread a checkpoint) is a :class:`LayoutsError`, with a
one-line message that names the file or tensor and what to do. An engine can catch that one type;
prep's CLI prints the message as it is. Each subclass stays in the module whose checks raise it.
"""

__all__ = [
    "LayoutsError",
]


class LayoutsError(ValueError):
    """Bad input to ``layouts``; the message is one line naming the file or tensor and the fix.

    A ``ValueError`` too, as each of its subclasses was before it existed."""
