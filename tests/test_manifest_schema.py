"""The manifest's typed schema (layouts/manifest/) against real conversions and against its
description (docs/manifest.md): reading a manifest and writing it back gives the same bytes,
and every key written is documented, every key documented exists."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import pytest

from layouts import manifest as schema
from layouts.manifest import Manifest, ManifestError, load_manifest
from layouts.engines import get_engine
from prep.convert import convert
from prep.deepseek import target_for
from prep.testing import PRESETS, SynthSpec, as_format_3
from checkpoints import write_checkpoint

ATOM = get_engine("atom")  # the engine whose profile these tests use

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "manifest.md"

# Both variants, plain TP and expert parallel; one Triton MoE layout, so scale_swizzle is written.
PRE_CK, RAW_TRITON = {"layout": "preshuffle", "moe_layout": "ck"}, {"layout": "non-shuffle", "moe_layout": "triton"}
CONVERSIONS = {
    "v2-tp2": ("v2", target_for(ATOM, **PRE_CK, tp=2)),
    "r1-tp2": ("r1-0528", target_for(ATOM, **RAW_TRITON, tp=2)),
    "v2-ep2": ("v2", target_for(ATOM, **PRE_CK, tp=2, ep=2)),
    "r1-ep2": ("r1-0528", target_for(ATOM, **PRE_CK, tp=2, ep=2)),
    "v2-tp2-format1": ("v2", target_for(ATOM, **PRE_CK, tp=2, rank_exact=False)),  # --common-bf16
    "fp8-block-tp2": ("r1-0528-fp8", target_for(ATOM, **PRE_CK, tp=2)),  # DeepSeek's FP8 release: fp8_layout, stacks of scales
    "fp8-channel-tp2": ("mtp-moefp4", target_for(ATOM, **PRE_CK, tp=2)),  # FP8 attention: fp8_channel_layouts
    "kimi-k2.5-tp2": ("kimi-k2.5", target_for(ATOM, **PRE_CK, tp=2)),  # a multimodal source: source.wrapper, version 5
    # SGLang's: the vision tower in each rank's files, its 1-D biases stored 1-D (flat groups)
    "kimi-k2.5-sglang-tp2": ("kimi-k2.5", target_for(get_engine("sglang"), tp=2)),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("schema")
    for variant in ("v2", "r1-0528"):  # random bytes: the manifest's shape is what matters here
        write_checkpoint(SynthSpec(variant=variant, random_bytes=True), root / f"src-{variant}")
    write_checkpoint(dataclasses.replace(PRESETS["r1-0528-fp8"], random_bytes=True), root / "src-r1-0528-fp8")
    write_checkpoint(SynthSpec(variant="mtp-moefp4", random_bytes=True), root / "src-mtp-moefp4")
    write_checkpoint(dataclasses.replace(PRESETS["kimi-k2.5"], num_hidden_layers=2, random_bytes=True),
                     root / "src-kimi-k2.5")
    outs = {}
    for name, (variant, target) in CONVERSIONS.items():
        convert(str(root / f"src-{variant}"), root / name, target)
        outs[name] = root / name
    return outs


def compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()  # as prep convert writes it


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_reading_and_writing_back_a_real_manifest_gives_its_bytes(converted, name):
    raw_bytes = (converted[name] / schema.MANIFEST_NAME).read_bytes()
    raw = json.loads(raw_bytes)
    m = load_manifest(converted[name])
    assert m.to_json() == raw
    assert compact(m.to_json()) == raw_bytes  # key order too: the completion marker hashes these bytes
    assert m.sha256 == schema.manifest_hash(raw_bytes)
    # Every file it is, byte for byte: the source table too (from format 4), which it names and hashes.
    table = (converted[name] / schema.SOURCE_TABLE_NAME).read_bytes()
    assert m.to_files() == {schema.SOURCE_TABLE_NAME: table, schema.MANIFEST_NAME: raw_bytes}
    assert m.source.table == schema.SourceTableRef(schema.SOURCE_TABLE_NAME, schema.manifest_hash(table),
                                                   len(json.loads(table)["tensors"]))
    again = Manifest.from_json(m.to_json(), converted[name])  # the folder: where its source table is
    assert again == m and again.to_json() == raw
    assert schema.Source.from_json(m.source.to_json(), converted[name]) == m.source
    for rec in [m.target, m.tool, *m.files.values(), *m.groups, *m.layouts.values(), *m.tensors]:
        assert type(rec).from_json(rec.to_json()) == rec, rec
    variant, target = CONVERSIONS[name]
    # fp8_layout is recorded only where FP8 weights are stored in it (the MXFP4 checkpoints have none)
    fp8 = target.fp8_layout if variant == "r1-0528-fp8" else None
    channel = target.fp8_channel_layouts if variant == "mtp-moefp4" else None
    # the conversion's own target, the one type: as given, with the source's arch (format 1 has no
    # layout for BF16 experts)
    bf16 = target.bf16_moe_layout if target.rank_exact else None
    assert m.target == dataclasses.replace(target, fp8_layout=fp8, fp8_channel_layouts=channel, bf16_moe_layout=bf16,
                                           arch="kimi_k25" if variant == "kimi-k2.5" else "deepseek_v3")
    assert (m.tp, m.ep, m.layout, m.moe_layout) == (target.tp, target.ep, target.layout, target.moe_layout)


# ------------------------------------------------------------------------------ docs/manifest.md
def documented() -> dict[str, dict[str, str]]:
    """{section: {field: when present}} from the tables of docs/manifest.md: a ``### ...`section`...``
    heading, then rows ``| `field` | type | present | meaning |``."""
    sections: dict[str, dict[str, str]] = {}
    current = None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"^### .*?`([^`]+)`", line)
        if heading:
            current = sections.setdefault(heading.group(1), {})
        elif current is not None and (row := re.match(r"^\| `([^`]+)` \| [^|]+ \| ([^|]+) \|", line)):
            current[row.group(1)] = row.group(2).strip()
    return sections


def written(out: pathlib.Path) -> dict[str, list[dict]]:
    """Every object of each documented section that one conversion wrote."""
    raw = json.loads((out / schema.MANIFEST_NAME).read_text())
    marker = json.loads((out / schema.COMPLETE_NAME).read_text())
    table = json.loads((out / schema.SOURCE_TABLE_NAME).read_text())
    grouped = [t for t in raw["tensors"] if "runtime_attrs" in t]  # tensors of a group
    return {
        "prep-manifest.json": [raw],
        "source": [raw["source"]],
        "source.files": list(raw["source"]["files"].values()),
        "source.tensors_file": [raw["source"]["tensors_file"]],
        "prep-source.json": [table],
        "source.tensors": list(table["tensors"].values()),
        "target": [raw["target"]],
        "layouts": list(raw["layouts"].values()),
        "files": list(raw["files"].values()),
        "groups": raw["groups"],
        "parts": [p for g in raw["groups"] if g["kind"] == "linear" for p in g["parts"]],
        "placements": [p for g in raw["groups"] if g["kind"] == "bf16" for p in g.get("placements", [])],
        "stack": [g["stack"] for g in raw["groups"] if "stack" in g],
        "windows": [w for g in raw["groups"] if "stack" in g for w in g["stack"]["windows"]],
        "tensors": raw["tensors"],
        "runtime_attrs": [t["runtime_attrs"] for t in grouped],
        "transforms": [{x["op"]: x} for t in raw["tensors"] for x in t["transforms"]],  # keyed by op
        "prep-complete.json": [marker],
    }


# Documented, but no conversion of a local folder writes them: a Hugging Face source's origin
# (tests/test_convert.py converts one), whole-file hashes, which convert never asks for, and the
# source table inside the manifest, which only versions 1-3 held.
NOT_WRITTEN_HERE = {("source", "repo_id"), ("source", "revision"), ("source", "snapshot"),
                    ("source.files", "xxh3_128"), ("source", "tensors")}


def test_every_field_written_is_documented_and_every_documented_field_exists(converted):
    doc = documented()
    seen: dict[str, set[str]] = {}
    for out in converted.values():
        for section, objects in written(out).items():
            fields = doc.get(section)
            assert fields is not None, f"docs/manifest.md has no table for `{section}`"
            for obj in objects:
                assert set(obj) <= set(fields), f"{section}: {sorted(set(obj) - set(fields))} written but not documented"
                for field, present in fields.items():
                    if present == "always" and section != "transforms":
                        assert field in obj, f"{section}.{field} is documented as always there but is missing"
                seen.setdefault(section, set()).update(obj)
                assert list(obj) == [f for f in fields if f in obj] or section == "transforms", \
                    f"{section}: written in the order {list(obj)}, documented in another"
    for section, fields in doc.items():
        missing = {f for f in fields if f not in seen.get(section, set())} - {f for s, f in NOT_WRITTEN_HERE if s == section}
        assert not missing, f"{section}: {sorted(missing)} documented but never written"


def test_the_documented_example_is_a_manifest_in_the_order_prep_writes(converted):
    blocks = re.findall(r"```json\n(.*?)```", DOC.read_text(), re.S)
    example, table, marker = (json.loads(b) for b in blocks[:3])
    m = Manifest.from_json(example)
    assert compact(m.to_json()) == compact(example)  # same keys, same order
    assert (m.format, m.format_version) == (schema.FORMAT, 4)
    assert m.source.table.count == 192 and table["format"] == schema.SOURCE_TABLE_FORMAT
    assert all(schema.SourceTensor.from_json(t).to_json() == t for t in table["tensors"].values())
    assert list(marker) == list(schema.Completion("", "", run="").to_json())
    assert f"now {schema.FORMAT_VERSION}" in DOC.read_text()  # the versioning section states the version


def test_another_format_version_is_refused_naming_the_fix():
    with pytest.raises(ManifestError, match="format_version 6 is not supported .*reads 1, 2, 3, 4, 5.*upgrade prep/layouts"):
        Manifest.from_json({"format": schema.FORMAT, "format_version": 6, "target": {}, "tensors": []})


def test_a_version_3_manifest_holding_its_source_table_still_verifies_and_reverts(converted, tmp_path):
    # What prep wrote before version 4: the source tensor table inside, as source.tensors.
    import shutil

    from click.testing import CliRunner

    from prep.cli import main

    out = shutil.copytree(converted["r1-tp2"], tmp_path / "v3")
    table = json.loads((out / schema.SOURCE_TABLE_NAME).read_text())["tensors"]
    data = as_format_3(out)

    m = load_manifest(out)
    assert m.source.table is None and len(m.source.tensors) == len(table)
    assert m.to_files() == {schema.MANIFEST_NAME: data}  # written back as it was, table inside
    src = converted["r1-tp2"].parent / "src-r1-0528"
    r = CliRunner().invoke(main, ["verify", str(out), "--source", str(src)])
    assert r.exit_code == 0 and f"{len(table)} source tensors byte-identical" in r.output, r.output
    r = CliRunner().invoke(main, ["revert", str(out), "-o", str(tmp_path / "rt")])
    assert r.exit_code == 0 and f"{len(table)} tensors" in r.output, r.output
