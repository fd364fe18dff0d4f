#!/usr/bin/env python3
"""A multi-GB checkpoint that prep did not generate: amd-quark quantizes and exports a
DeepSeek-V3-shaped transformers model (hidden 2048, 64 experts of 1024, BF16 attention as the
deepseek_v3 template leaves it, MXFP4 weights and activations as R1-0528-MXFP4), on a machine
that could not hold the model's BF16 weights.

    .venv/bin/python scripts/make_quark_export.py OUT [--layers 23] [--seed 0]

23 layers give a 5.09 GiB ``model.safetensors`` (8,840 tensors) in about 5 minutes on the 2-core
VM, peak RSS 6.7 GB. How it fits: the model is built on the meta device, the MLP linears' weights
(the experts, 99% of the bytes) are views at random offsets into one shared 512 MiB pool of
random BF16 values, every other parameter is its own random tensor; glibc is told to return
freed memory (without that, quark's export grew past 24 GB at 22 layers: its per-linear
temporaries fragmented the heap). The values are random, so the export is a benchmark input,
not a model; ``tests/quark_export.py`` makes the small exports whose numerics the tests check.
Needs the test environment (amd-quark, transformers): ``scripts/setup_env.sh --tests``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

POOL_VALUES = 1 << 28  # 512 MiB of BF16 that every MLP weight is a window of


def _return_freed_memory() -> None:
    """glibc: big blocks mapped on their own and trimmed when freed, one arena."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    for param, value in ((-8, 1), (-3, 64 << 10), (-1, 0)):  # M_ARENA_MAX, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
        libc.mallopt(param, value)


def build(layers: int, seed: int):
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from quark.torch.utils.llm import preprocess_for_quantization

    import quark_export

    config = dict(quark_export.CONFIG, hidden_size=2048, moe_intermediate_size=1024, intermediate_size=4096,
                  n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4, num_hidden_layers=layers,
                  vocab_size=32768, num_attention_heads=16, num_key_value_heads=16, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=512, kv_lora_rank=256)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM._from_config(DeepseekV3Config(**config), dtype=torch.bfloat16)
    preprocess_for_quantization(model)  # fused 3-D experts -> per-expert nn.Linear, as in R1
    gen = torch.Generator().manual_seed(seed)
    pool = (0.05 * torch.randn(POOL_VALUES + (1 << 24), generator=gen)).to(torch.bfloat16)
    with torch.no_grad():
        for mname, mod in model.named_modules():
            for pname, p in list(mod._parameters.items()):
                if p is None or p.device.type != "meta":
                    continue
                if isinstance(mod, torch.nn.Linear) and pname == "weight" and ".mlp." in mname \
                        and p.numel() <= 1 << 24:
                    off = int(torch.randint(0, POOL_VALUES, (1,), generator=gen))
                    value = pool[off:off + p.numel()].view(p.shape)
                elif mname.endswith("norm") or pname.endswith("norm.weight"):
                    value = (1.0 + 0.1 * torch.randn(p.shape, generator=gen)).to(p.dtype)
                else:  # the router is BF16 in R1's checkpoint
                    value = (0.05 * torch.randn(p.shape, generator=gen)).to(torch.bfloat16)
                mod._parameters[pname] = torch.nn.Parameter(value, requires_grad=False)
            for bname, b in list(mod._buffers.items()):
                if b is not None and b.device.type == "meta" and bname.endswith("e_score_correction_bias"):
                    mod._buffers[bname] = (0.01 * torch.randn(b.shape, generator=gen)).to(b.dtype)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise SystemExit(f"error: left on the meta device: {left[:5]}")
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--layers", type=int, default=23, help="decoder layers (the first dense, the rest MoE)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"error: {args.out} is not empty; give a new folder")
    _return_freed_memory()
    os.environ.setdefault("QUARK_LOG_LEVEL", "warning")
    import torch
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors

    t0 = time.perf_counter()
    model = build(args.layers, args.seed)
    qcfg = LLMTemplate.get("deepseek_v3").get_config(scheme="mxfp4")  # attention excluded: BF16
    with torch.no_grad():
        model = ModelQuantizer(qcfg).quantize_model(model, None)
    export_safetensors(model, str(args.out), custom_mode="quark", weight_format="real_quantized",
                       pack_method="reorder")
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(f"{args.out}: {size / 2**30:.2f} GiB, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
