"""``check-quark-export``: the engine doors on a checkpoint prep's generator did not write: amd-quark 0.13 exports the
tiny transformers-5 DeepseekV3 of tests/quark_export.py in W4A4 MXFP4 (scheme "mxfp4": weights
and dynamic activations, attention left BF16 by the deepseek_v3 template, as
amd/DeepSeek-R1-0528-MXFP4 is; once more with the shared experts left BF16 too; and once with
the attention FP8 per channel, as MTP-MoEFP4 and the AttnFP8 checkpoints are); prep
converts each for each engine; ``check-engine`` compares the engine's load of the conversion
with its own load of the export, rank by rank; then one byte of a rank file is flipped and the
same check must fail.

    .venv/bin/python -m harness check-quark-export [--engines atom,vllm,sglang] [--variants ...] [--work DIR]

One line per (export, engine, TP/EP): the check's result on the conversion and on the flipped copy.
Exit status 0 only if every conversion passes and every flipped copy fails. Such an export's
config.json (saved by transformers 5) lacks DeepSeek-V3's topk_method, scoring_func and
moe_layer_freq; the SGLang and vLLM serve commands, and so both loads here, pass them
(layouts/engines/_config.py); ATOM's door takes no override, so for ATOM a copy of the export
with them added to config.json is converted, as prep's note says to do.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import struct
import subprocess
import sys

from harness import REPO, report

# The exports (quark_export.export's keywords): Quark's deepseek_v3 template excludes (attention
# BF16, as R1-0528's card); the shared experts excluded too (BF16 beside MXFP4 routed experts: an
# MLP of their own in every engine); and every *self_attn* linear FP8 per channel (quark's ptpc_fp8:
# MTP-MoEFP4's recipe and the AttnFP8 checkpoints'; quark 0.13 writes those scales BF16).
VARIANTS = {"w4a4": {"exclude_layers": None},
            "w4a4-bf16-shared": {"exclude_layers": ["*self_attn*", "*shared_experts*", "lm_head"]},
            "w4a4-fp8-attention": {"exclude_layers": ["*mlp.gate", "lm_head"], "layer_config": {"*self_attn*": "ptpc_fp8"}}}
# (tp, ep) per engine; vLLM's TP 2 alone is refused for the tiny experts (256 intermediate: ck-3d's K/32 % 8)
CONFIGS = {"atom": ((2, 1), (2, 2)), "vllm": ((2, 2),), "sglang": ((2, 1), (2, 2))}
# The engines whose door does not serve a variant (prep convert refuses it for them, in one line)
REFUSED = {"w4a4-fp8-attention": ("sglang",)}


def flip_a_byte(folder: pathlib.Path) -> str:
    """Flip one byte in the middle of the largest tensor of the last rank's first file; its name."""
    f = sorted(folder.glob("model-tp*-rank*-*.safetensors"))[-1]
    with open(f, "r+b") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
        name, info = max(((k, v) for k, v in header.items() if k != "__metadata__"),
                         key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
        at = 8 + n + (info["data_offsets"][0] + info["data_offsets"][1]) // 2
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x01]))
    return name


def check_variant(variant: str, work: pathlib.Path, engines: list[str]) -> bool:
    """One export (:data:`VARIANTS`) through ``engines``' doors; prints a line per (engine, TP/EP)."""
    sys.path.insert(0, str(REPO / "tests"))  # the export itself is the tests' (tests/quark_export.py)
    import quark_export

    src = work / f"export-{variant}"
    if not (src / "config.json").is_file():
        quark_export.export(src, scheme="mxfp4", **VARIANTS[variant])
    cfg = json.loads((src / "config.json").read_text())
    print(f"amd-quark export {variant}: {src} (input_tensors "
          f"{cfg['quantization_config']['global_quant_config']['input_tensors']['dtype']}, exclude "
          f"{len(cfg['quantization_config']['exclude'])} entries)", flush=True)
    # ATOM's door passes no config override: prep's note says to add the missing DeepSeek-V3 keys
    # to the source's config.json, which a copy here does (the tensors hard-linked, unchanged).
    from layouts.engines import _config

    fixed = work / f"export-{variant}-config-completed"
    if not fixed.is_dir():
        fixed.mkdir()
        for f in src.iterdir():
            if f.name != "config.json":
                (fixed / f.name).hardlink_to(f)
        (fixed / "config.json").write_text(json.dumps({**cfg, **_config.missing_keys(cfg)}, indent=2))
    ok = True
    for engine in engines:
        source = fixed if engine == "atom" else src
        for tp, ep in CONFIGS[engine]:
            out = work / f"{variant}-{engine}-tp{tp}-ep{ep}"
            shutil.rmtree(out, ignore_errors=True)
            r = subprocess.run([sys.executable, "-m", "prep", "convert", str(source), "-o", str(out), "--engine",
                                engine, "--tp", str(tp), "--ep", str(ep), "-q"], capture_output=True, text=True, cwd=REPO)
            if engine in REFUSED.get(variant, ()):
                ok &= r.returncode == 1 and not out.exists()
                print(f"{variant} {engine} tp{tp} ep{ep}: convert {'refuses' if r.returncode else 'DOES NOT REFUSE'} "
                      f"({r.stderr.strip()[:160]})", flush=True)
                continue
            if r.returncode:
                print(f"{variant} {engine} tp{tp} ep{ep}: convert failed: {r.stderr.strip()}")
                ok = False
                continue

            def check(folder: pathlib.Path) -> tuple[int, str]:
                c = subprocess.run([sys.executable, "-m", "harness", "check-engine", engine, "--source", str(source),
                                    "--converted", str(folder), "--work", str(work / f"{engine}-work")],
                                   capture_output=True, text=True, cwd=REPO)
                if c.returncode == 0:
                    return 0, f"{len(report.rows(c.stdout))} ranks byte-identical"
                lines = c.stdout.splitlines()
                failed = next((i for i, line in enumerate(lines) if line.endswith(" FAIL")), None)
                # a failing row's problems come first under it, its notes after them
                first = lines[failed + 1].strip() if failed is not None and failed + 1 < len(lines) and \
                    lines[failed + 1].startswith("    ") else None
                return c.returncode, first or (c.stderr.strip().splitlines() or ["?"])[-1]

            rc, said = check(out)
            flipped = work / f"{variant}-{engine}-tp{tp}-ep{ep}-flipped"
            shutil.rmtree(flipped, ignore_errors=True)
            shutil.copytree(out, flipped)
            name = flip_a_byte(flipped)
            frc, fsaid = check(flipped)
            ok &= rc == 0 and frc != 0
            print(f"{variant} {engine} tp{tp} ep{ep}: conversion {'passes' if rc == 0 else 'FAILS'} ({said}); "
                  f"one byte of {name} flipped: {'fails' if frc else 'PASSES'} ({fsaid})", flush=True)
    return ok

