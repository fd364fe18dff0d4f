"""A JSON value's type, checked: what every record's ``from_json`` builds on."""

from __future__ import annotations

from typing import Any

from .format import ManifestError


def _is_count(value: Any, low: int = 0) -> bool:
    """An integer >= ``low``; type(): True and 1.0 are not counts."""
    return type(value) is int and value >= low


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ManifestError(f"{what} is {type(value).__name__}, not an object")
    return value


def _string_list(value: Any, what: str) -> tuple[str, ...]:
    if type(value) is not list or not all(type(v) is str for v in value):
        raise ManifestError(f"{what} is not a list of strings")
    return tuple(value)
