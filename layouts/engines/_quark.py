"""Quark's ``exclude`` list as the engines read it: SGLang 0.5.23 and vLLM 0.34.0 match an entry only
exactly or as a ``re:`` regex (``should_ignore_layer``), never as the shell wildcard Quark itself
accepts (``*self_attn*``). A config with wildcards makes them build the excluded modules as MXFP4
and fail on their BF16 weights, from the source and from a conversion alike; their serve commands
override the config's ``quantization_config`` with the same entries as ``re:`` patterns
(SGLang ``--json-model-override-args``, vLLM ``--hf-overrides``), and config.json stays the
source's, for ``revert``."""

from __future__ import annotations

import re
from typing import Mapping


def wildcard_excludes(config: Mapping) -> list[str]:
    """The ``exclude`` entries of ``config``'s ``quantization_config`` that are shell wildcards."""
    q = config.get("quantization_config") if isinstance(config, Mapping) else None
    excl = q.get("exclude") if isinstance(q, Mapping) else None
    return [e for e in excl or () if isinstance(e, str) and not e.startswith("re:") and any(c in e for c in "*?")]


def excludes_as_regex(config: Mapping) -> dict | None:
    """The config override that states ``config``'s wildcard excludes as ``re:`` patterns: its
    ``quantization_config`` with each such entry rewritten (the engine replaces the attribute
    whole); None when it has none."""
    wild = wildcard_excludes(config)
    if not wild:
        return None
    q = dict(config["quantization_config"])
    q["exclude"] = [as_regex(e) if e in wild else e for e in q["exclude"]]
    return {"quantization_config": q}


def as_regex(entry: str) -> str:
    """A shell-wildcard entry (``*``, ``?``) as the ``re:`` pattern that means the same, anchored at
    both ends as a wildcard match is (plain syntax: the engine may run an older Python)."""
    return "re:" + re.escape(entry).replace(r"\*", ".*").replace(r"\?", ".") + "$"


def wildcard_note(config: Mapping, engine: str, flag: str) -> list[str]:
    """One line for ``prep convert`` where ``config`` has wildcard excludes (module docstring)."""
    wild = wildcard_excludes(config)
    if not wild:
        return []
    return [f"config.json's Quark exclude entries {', '.join(map(repr, wild))} are shell wildcards, which {engine} "
            "matches as exact names only (it would build those modules as MXFP4 and fail on their BF16 weights): "
            f"the serve command prep prints for a conversion passes them as re: patterns ({flag})"]
