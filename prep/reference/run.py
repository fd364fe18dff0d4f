"""``prep run`` / ``prep compare``: run the reference DeepSeek forward on a checkpoint (source or
converted, any layout and TP, ranks combined in-process) and compare two checkpoints' logits."""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Any, Mapping

import torch

import layouts
from layouts.families import language_config

from ..errors import PrepError
from .config import check_model_config
from .model import DeepseekV3, ForwardOptions, LatentCache
from ..verify import verify_tensors_read
from .weights import MAX_MEMORY, load_weights

def engine_for(manifest: layouts.Manifest | None, gemm_path: str | None, source_engine: layouts.EngineProfile | None
               ) -> tuple[layouts.EngineProfile | None, str | None, layouts.EngineConfig | None]:
    """The engine and its GEMM path to emulate, and (converted checkpoints, given by their
    ``manifest``) the engine configuration it is checked against: the configuration of the
    engine it was converted for that reads its layouts (:meth:`layouts.EngineConfig.reading`).
    A source is read in its own byte order, by ``source_engine``'s path that reads the
    source-order dense layout (None: no engine, for a run without activation quant)."""
    if manifest is None:
        if source_engine is None:
            return None, None, None
        if gemm_path is not None and gemm_path not in source_engine.gemm_paths:
            raise PrepError(f"--gemm-path {gemm_path}: not a GEMM path of {source_engine.display_name}, which reads "
                            f"the source; choose one of {', '.join(source_engine.gemm_paths)}")
        source_order = layouts.registry.source_order_layout("dense").name
        return source_engine, gemm_path or source_engine.gemm_path_reading(source_order), None
    engine = layouts.EngineConfig.reading(manifest, gemm_path)
    return engine.profile, engine.gemm_path, engine


GEMMS = ("torch", "aiter-triton")  # who computes the dense MXFP4 GEMMs (prep/reference/dense_gemm.py)


def run(model_dir: str | pathlib.Path, prompt_ids: list[int], *, layers: int | None = None, device: str = "cpu",
        act_quant: bool = True, gemm_path: str | None = None, source_engine: layouts.EngineProfile | None = None,
        assume_layout: str | None = None,
        gemm: str = "torch", aiter_dir: str | None = None, verify: bool = True, max_memory: int = MAX_MEMORY,
        progress: Mapping[str, Any] | None = None, prefill: int | None = None, kv_cache: str = "latent",
        generate: int = 0, latent_kv: bool = False, mla_order: str = "reference") -> dict[str, Any]:
    """Logits ``[T, vocab]`` (float32) of ``prompt_ids``, and how long loading and the forward took.

    ``prefill`` K: the first K ids run as one prefill, then each other id as one decode step
    (teacher-forced), against a latent cache with ``kv_b_proj`` absorbed (``kv_cache="latent"``)
    or recomputing every position from the whole prefix (``"none"``); one row of logits per id
    either way. ``generate`` N: then N greedy tokens (``"generated"``). ``latent_kv``: the full
    forward's keys and values as the latent decode computes them (see :class:`ForwardOptions`).

    ``gemm="aiter-triton"`` computes every dense MXFP4 GEMM with aiter's own Triton kernel for the
    checkpoint's dense layout (from ``aiter_dir``, see :mod:`prep.reference.aiter_gemm`), with that kernel's
    activation flags; MoE experts stay on the dequantize-and-matmul path.

    ``source_engine``: the engine whose GEMM path (``gemm_path``, else the one reading the source's
    byte order) a source's activations are quantized for (prep run: its default engine); a
    converted checkpoint is read by the engine it was converted for.

    ``assume_layout`` reads a converted checkpoint's MXFP4 tensors as that layout and skips the
    compatibility check (to see what a mismatch does); otherwise a converted checkpoint is checked
    against the engine configuration that reads it, as an engine would. ``verify`` checks the hash
    of every tensor of a converted checkpoint the forward reads first. ``progress``: bars (a
    ``total(n)`` method, called with each step's count) for ``"check"`` (bytes hashed) and
    ``"forward"`` (layers run). ``max_memory``: the bound on this process's resident memory that
    the weights' cache keeps to (:mod:`prep.reference.weights`)."""
    root = pathlib.Path(model_dir)
    if not root.is_dir():
        raise PrepError(f"{root}: no such directory")
    if layers is not None and layers < 1:
        raise PrepError(f"--layers {layers}: run at least one layer")
    if assume_layout is not None and assume_layout not in layouts.layout_names():
        raise PrepError(f"--assume-layout {assume_layout!r}: not a layout; known: {', '.join(layouts.layout_names())}")
    if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
        raise PrepError(f"--device {device}: no such device here; use cpu" + (" or cuda" if torch.cuda.is_available() else ""))
    # Parsed once: a TP 8 R1 manifest describes tens of thousands of tensors.
    manifest = layouts.load_manifest(root) if (root / layouts.manifest.MANIFEST_NAME).is_file() else None
    if gemm not in GEMMS:
        raise PrepError(f"--gemm {gemm!r}: choose one of {', '.join(GEMMS)}")
    if gemm == "aiter-triton":
        from .dense_gemm import kernel_gemm_path

        kernel_path = kernel_gemm_path(manifest, assume_layout)
        if gemm_path not in (None, kernel_path):
            raise PrepError(f"--gemm-path {gemm_path}: with --gemm aiter-triton the activation is quantized for the "
                            f"kernel that runs, whose path is {kernel_path}; leave --gemm-path out")
    profile, path, engine = engine_for(manifest, None if gemm == "aiter-triton" else gemm_path, source_engine)
    if act_quant and profile is None and gemm != "aiter-triton":  # aiter's kernel's own path, below
        raise PrepError("a source's activations are quantized as an engine's GEMM path does: give source_engine "
                        "(prep run reads a source as its default engine does), or act_quant=False")
    if engine is not None and assume_layout is None:
        try:
            layouts.check_compatibility(manifest, engine)
        except layouts.CompatibilityError as e:
            raise PrepError(str(e)) from None
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    if ids.numel() == 0:
        raise PrepError("--prompt-ids: give at least one token id")
    if kv_cache not in KV_CACHES:
        raise PrepError(f"--kv-cache {kv_cache!r}: choose one of {', '.join(KV_CACHES)}")
    if prefill is not None and not 1 <= prefill <= ids.numel():
        raise PrepError(f"--prefill {prefill}: give 1 to {ids.numel()} (the number of prompt ids)")
    if generate < 0:
        raise PrepError(f"--generate {generate}: give 0 or more tokens")
    if mla_order not in MLA_ORDERS:
        raise PrepError(f"--mla-order {mla_order!r}: choose one of {', '.join(MLA_ORDERS)}")
    bars = progress or {}
    hashed = None
    if manifest is not None and verify:
        n_layers = language_config(json.loads((root / "config.json").read_text()))["num_hidden_layers"]
        hashed = verify_tensors_read(manifest, n_layers if layers is None else min(layers, n_layers), bars.get("check"))
        getattr(bars.get("check"), "close", lambda: None)()  # done before the forward's bar starts below it
    t0 = time.perf_counter()
    weights = load_weights(root, assume_layout, manifest, max_memory=max_memory)
    check_model_config(weights.config, root, len(weights), len(ids) + generate)  # before the model is built
    weights.check_config()
    if device != "cpu":
        weights.to(device)
    vocab = weights.config.get("vocab_size", 0)
    if int(ids.max()) >= vocab or int(ids.min()) < 0:
        raise PrepError(f"--prompt-ids: ids must be in [0, {vocab}) for this model")
    t1 = time.perf_counter()
    dense = None
    if gemm == "aiter-triton" and act_quant:
        from . import aiter_gemm
        from .dense_gemm import AiterDenseGemms

        dense = AiterDenseGemms(root, manifest, assume_layout=assume_layout, device=device, aiter_dir=aiter_dir)
        # the checkpoint is checked against its engine; the kernel reads its own path's flags
        profile, path = aiter_gemm.KERNEL_ENGINE, kernel_path
    elif gemm == "aiter-triton":
        raise PrepError("--gemm aiter-triton needs --act-quant: aiter's kernels multiply MXFP4 activations")
    model = DeepseekV3(weights, ForwardOptions(act_quant=act_quant, engine=profile, gemm_path=path,
                                               latent_kv=latent_kv, mla_order=mla_order),
                       layers=layers, dense_gemm=dense)
    decoding = prefill is not None or generate > 0
    k = ids.numel() if prefill is None else prefill
    if bars.get("forward") is not None:
        _count_layers(model, bars["forward"], steps=1 + (ids.numel() - k) + generate if decoding else 1)
    generated: list[int] = []
    try:
        if decoding:
            logits, generated = decode(model, ids, k, kv_cache, generate, device)
        else:
            logits = model(ids, device)
        if device != "cpu":
            torch.cuda.synchronize()
    finally:
        weights.release()  # compare's second run must not share the budget with the first's matrices
    t2 = time.perf_counter()
    return {"logits": logits.cpu(), "load_s": t1 - t0, "forward_s": t2 - t1, "weights": weights.description,
            "gemm_path": path, "act_quant": act_quant, "layers": model.num_layers, "gemm": gemm,
            "converted": manifest is not None, "hashes_checked": hashed, "evictions": weights.evictions,
            "peak_rss": peak_rss(), "max_memory": max_memory,
            **({"prefill": k, "kv_cache": kv_cache, "generated": generated, "mla_order": mla_order,
                "kv_cache_bytes_per_token": LatentCache.bytes_per_token(weights.config, model.num_layers)
                if kv_cache == "latent" else 0,
                "per_head_kv_bytes_per_token": per_head_kv_bytes(weights.config, model.num_layers)} if decoding else {})}


KV_CACHES = ("latent", "none")
MLA_ORDERS = ("reference", "sglang")  # how a latent decode multiplies by W_UK / W_UV (ForwardOptions)


def decode(model: DeepseekV3, ids: torch.Tensor, prefill: int, kv_cache: str, generate: int,
           device: str) -> tuple[torch.Tensor, list[int]]:
    """Logits of every id (a prefill of the first ``prefill``, then one decode step per id) and
    ``generate`` greedy tokens after them; see :func:`run`."""
    if kv_cache == "latent":
        cache = LatentCache()

        def step(new: torch.Tensor, _seen: torch.Tensor) -> torch.Tensor:
            return model(new, device, cache=cache)
    else:  # no cache: every position computed again from its whole prefix

        def step(new: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
            return model(seen, device)[-new.numel():]

    rows = [step(ids[:prefill], ids[:prefill])]
    for t in range(prefill, ids.numel()):
        rows.append(step(ids[t:t + 1], ids[:t + 1]))
    generated: list[int] = []
    seq, last = ids, rows[-1][-1]
    for _ in range(generate):
        token = torch.tensor([int(last.argmax())], dtype=torch.long)
        generated.append(int(token))
        seq = torch.cat([seq, token])
        last = step(token, seq)[-1]
    return torch.cat(rows), generated


def per_head_kv_bytes(cfg: Mapping[str, Any], layers: int) -> int:
    """BF16 bytes per token of the cache a decode without the latent trick would hold: every
    head's key (nope + rope) and value, per layer."""
    return 2 * cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) \
        * layers


def peak_rss() -> int | None:
    """This process's peak resident memory so far, in bytes (what --max-memory bounds), or None
    where the platform does not say."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _count_layers(model: DeepseekV3, bar: Any, steps: int = 1) -> None:
    """Tick ``bar`` once per decoder layer the forward finishes (this instance only), over
    ``steps`` forwards (a prefill and its decode steps): the layers are what takes the time, each
    dequantizing its weights on first use."""
    bar.total(model.num_layers * steps)
    layer = model.decoder_layer

    def counted(*args, **kwargs):
        out = layer(*args, **kwargs)
        bar(1)
        return out

    model.decoder_layer = counted


def compare(a: str | pathlib.Path, b: str | pathlib.Path, prompt_ids: list[int], *, gemm_a: str | None = None,
            gemm_b: str | None = None, prefill_b: int | None = None, **kw) -> dict[str, Any]:
    """Run both checkpoints on the same tokens: max |difference| of logits, and whether equal bit for bit.
    ``gemm_a`` / ``gemm_b`` pick each side's dense GEMM (default: ``kw``'s ``gemm``, else torch);
    ``prefill_b``: B's ``prefill`` (default: ``kw``'s)."""
    gemm = kw.pop("gemm", "torch")
    ra = run(a, prompt_ids, gemm=gemm_a or gemm, **kw)
    rb = run(b, prompt_ids, gemm=gemm_b or gemm, **{**kw, **({"prefill": prefill_b} if prefill_b else {})})
    la, lb = ra["logits"], rb["logits"]
    if la.shape != lb.shape:
        raise PrepError(f"logits shapes differ: {list(la.shape)} vs {list(lb.shape)}; not the same model")
    finite = {"a": bool(torch.isfinite(la).all()), "b": bool(torch.isfinite(lb).all())}
    # A NaN never compares greater than a tolerance: non-finite logits count as an infinite difference.
    diff = float((la - lb).abs().max()) if all(finite.values()) else float("inf")
    return {"a": ra["weights"], "b": rb["weights"], "gemm_a": ra["gemm"], "gemm_b": rb["gemm"],
            "max_abs_diff": diff, "max_abs_logit": float(la.abs().max()) if finite["a"] else float("inf"),
            "finite": finite,
            "converted": {"a": ra["converted"], "b": rb["converted"]},
            "hashes_checked": {"a": ra["hashes_checked"], "b": rb["hashes_checked"]},
            "identical": all(finite.values()) and bool(torch.equal(la, lb)),
            "evictions": {"a": ra["evictions"], "b": rb["evictions"]},
            "argmax_agree": float((la.argmax(-1) == lb.argmax(-1)).float().mean()), "tokens": len(prompt_ids),
            "peak_rss": rb["peak_rss"], "max_memory": rb["max_memory"]}
