"""What the engine checks read of a converted folder beside its tensors: its manifest's target and
the config override its serve command passes."""

from __future__ import annotations

import json
import pathlib

ENGINE_NAMES = {"atom": "ATOM", "sglang": "SGLang", "vllm": "vLLM"}


def target(out: pathlib.Path, engine: str):
    """``out``'s manifest target, which must be of a conversion for ``engine`` (else one line)."""
    import layouts

    t = layouts.load_manifest(out).target
    if t.engine != engine:
        raise SystemExit(f"error: {out}: converted for {t.engine}, not {ENGINE_NAMES[engine]}; convert with --engine "
                         f"{engine}")
    return t


def config_override(out: pathlib.Path, flag: str) -> tuple[dict | None, list[str]]:
    """``(override, what to say)``: what the serve command passes ``flag`` for ``out``'s
    config.json (wildcard Quark excludes as ``re:`` patterns, DeepSeek-V3 keys a transformers-5
    config lacks: ``layouts.engines._config``), given to both loads alike; None where it passes
    nothing."""
    from layouts.engines import _config

    override = _config.override(json.loads((out / "config.json").read_text()))
    said = []
    if override and "quantization_config" in override:
        said.append(f"both loads: {flag} with the Quark excludes as re: patterns: "
                    f"{override['quantization_config']['exclude']}")
    keys = sorted(set(override or ()) - {"quantization_config"})
    if keys:
        said.append(f"both loads: {flag} with DeepSeek-V3's {', '.join(keys)}, which config.json lacks")
    return override, said
