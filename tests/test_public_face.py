"""What the runtime library shows: its top level is what an engine needs (open a rank and check it,
load it, plan its activation quant), every public module says its names in ``__all__``, and prep
uses only those (or its own): a name prep reaches for outside them is a name that can change under
it without notice."""

from __future__ import annotations

import ast
import importlib
import pathlib

import layouts

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The engine's face: adding to it is a decision (docs/ARCHITECTURE.md), not a side effect.
ENGINE_FACE = {
    "load_manifest", "Manifest", "ManifestError", "TensorRecord",
    "EngineConfig", "check_compatibility", "CompatibilityError", "LayoutsError",
    "get_engine", "engine_names", "EngineProfile", "register_engine",
    "open_rank", "OpenRank", "load_rank", "RankTensors", "iter_rank_files",
    "ActivationQuantPlan", "ActivationQuantFlags", "select_activation_quant",
    "fused_rms_mxfp4_quant", "fused_rms_fp8_quant",
    "MlaShape", "absorbed_kv_b", "absorbed_kv_b_of_rank",
    "Layout", "get_layout", "layout_names", "register_layout",
}


def _public_modules() -> list[str]:
    """Every module of layouts/ whose dotted name has no part starting with an underscore."""
    out = []
    for p in sorted((ROOT / "layouts").rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not any(x.startswith("_") for x in parts):
            out.append(".".join(parts))
    return out


def test_the_top_level_is_the_engines_face():
    assert set(layouts.__all__) == ENGINE_FACE
    assert len(layouts.__all__) == len(ENGINE_FACE)  # no name twice


def test_every_public_module_lists_its_names_and_has_them():
    missing = []
    for name in _public_modules():
        mod = importlib.import_module(name)
        if not hasattr(mod, "__all__"):
            # the manifest package's modules are its implementation: layouts.manifest lists their names
            if not name.startswith(("layouts.manifest.", "layouts.engines.atom.", "layouts.engines.vllm.door")):
                missing.append(name)
            continue
        absent = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert not absent, f"{name}.__all__ names {absent}, which it does not define"
    assert not missing, f"public modules without __all__: {missing}"


def test_prep_imports_only_names_the_library_lists():
    """Every ``from layouts... import name`` in prep (at any depth) names a submodule or a name in
    that module's ``__all__``."""
    problems = []
    for p in sorted((ROOT / "prep").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] == "layouts"):
                continue
            mod = importlib.import_module(node.module)
            listed = set(getattr(mod, "__all__", ()))
            for alias in node.names:
                if alias.name in listed:
                    continue
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")  # a submodule
                except ImportError:
                    problems.append(f"{p.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    assert not problems, "prep imports names the library does not list:\n" + "\n".join(problems)
