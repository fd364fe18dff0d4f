"""Serve a converted checkpoint with ATOM's own OpenAI server: the door.

    prep-atom-serve --model r1-tp8 --tensor-parallel-size 8 [any option of ATOM's server]
    python -m layouts.engines.atom.serve --model r1-tp8 --tensor-parallel-size 8 [...]

runs ``python -m atom.entrypoints.openai_server`` with the same arguments, unchanged, after
checking the folder, and makes each worker process ATOM starts install its own rank of the
converted folder (target model and MTP draft model) through the adapter instead of reading a
checkpoint. ATOM's post-processing, its record of loaded names, its coverage report ("N/M model
parameters were NOT loaded") and its drafter's head sharing all run as they do on ATOM's own
load, on what the adapter installed.

Before ATOM starts, the door refuses in one line (exit status 2): a ``--model`` that is not a
complete prep conversion, a folder missing a side file the source had (tokenizer, config,
generation config, chat template), a manifest the configuration would misread (another TP or EP
size, a layout the GEMM path or MoE back end does not read), ATOM options that change which
weights a rank holds in ways not checked (pipeline, data or context parallel, DP attention, EPLB,
dummy weights, online quantization, another MoE back end), and an ATOM whose seams differ from
the ATOM it was checked against (naming the version seen and what differs).

ATOM's CK MoE reads a ``--moe-layout ck`` conversion, its Triton MoE (``ATOM_USE_TRITON_MOE=1``,
ATOM's default on gfx94x) a ``triton`` one (``triton-gfx942`` on MI300). ``prep convert`` and
``prep inspect`` print the command for a folder, switches included, e.g.

    ATOM_USE_TRITON_MOE=0 prep-atom-serve --model r1-tp8 --tensor-parallel-size 8 --method mtp

The seams, as ROCm/ATOM has them at commit ffdf3bb5 (:data:`CHECKED_ATOM`), and what is done at each:

1. ``EngineArgs._get_engine_kwargs`` (``atom/model_engine/arg_utils.py``), in the server process:
   wrapped to add ``runner_qualname`` (a ``Config`` field, ATOM's own way to run a subclass of its
   ``ModelRunner`` in every worker: its ``AsyncLLMEngine`` injects ``RLHFModelRunner`` so) naming
   :class:`ConvertedModelRunner`, when ``--model`` is a converted folder. Nothing else changes.
2. ``ConvertedModelRunner`` (``ModelRunner``'s subclass, imported by qualname in each worker):
   before ``ModelRunner.__init__`` allocates anything, checks the worker's seams and the manifest
   against the switches as this worker reads them (TP size and rank, expert parallel, the GPU
   arch aiter reports, the GEMM/MoE switches), then lets ATOM build its models as usual.
3. ``atom.model_loader.loader.load_weights_into_model`` (the checkpoint-reading step that ATOM's
   ``load_model`` calls for the target model and, with ``spec_decode``, for the MTP draft model),
   in each worker: for the converted folder it installs the rank (target) or the MTP layer set
   aside (draft), hands the installed names to ATOM's ``_report_coverage`` and returns them as
   ATOM's loaded-names record (so the drafter keeps its installed ``shared_head.head``); for any
   other path it is ATOM's own function.

This module is the entry point and the server process (seam 1); what the door checks is in
:mod:`.serve_checks` (the folder, ATOM's options, each rank's configuration) and :mod:`.seams`
(ATOM's code), the worker's side (seams 2 and 3) in :mod:`.worker`.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import sys
from typing import Any, Mapping

from .._compat import CompatibilityError, EngineConfig
from ...errors import LayoutsError
from ...manifest import MANIFEST_NAME, Manifest
from . import PROFILE
from .seams import check_server_seams, import_atom
from .serve_checks import (PROG, ServeError, check_draft, check_folder, check_options, check_vocab_embed,
                           converted_root, engine_config)
from .worker import RUNNER, _converted_model_runner

ATOM_SERVER = "atom.entrypoints.openai_server"


def __getattr__(name: str) -> Any:  # ATOM's worker resolves RUNNER by name (resolve_obj_by_qualname)
    if name == "ConvertedModelRunner":
        cls = globals()["ConvertedModelRunner"] = _converted_model_runner()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------- the server process
def inject_runner() -> None:
    """Seam 1: every engine built from a converted folder runs :class:`ConvertedModelRunner`."""
    from atom.model_engine.arg_utils import EngineArgs

    original = EngineArgs._get_engine_kwargs
    if hasattr(original, "__wrapped__"):
        return

    def engine_kwargs(self):
        kwargs = original(self)
        if converted_root(self.model) is not None:
            kwargs["runner_qualname"] = RUNNER
        return kwargs

    engine_kwargs.__wrapped__ = original
    EngineArgs._get_engine_kwargs = engine_kwargs


def parse_engine_args(argv: list[str]) -> Any:
    """ATOM's ``EngineArgs`` from the command line, parsed by ATOM's own parser (the server's
    own options, such as ``--server-port``, are left for the server)."""
    from atom.model_engine.arg_utils import EngineArgs
    from atom.utils.arg_parser import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog=PROG, add_help=False)
    EngineArgs.add_cli_args(parser)
    known, _ = parser.parse_known_args(argv)
    return EngineArgs.from_cli_args(known)


def check_start(argv: list[str], env: Mapping[str, str] | None = None,
                gpu_arch: str | None = None) -> tuple[pathlib.Path, Manifest, list[EngineConfig]]:
    """Everything the door checks before ATOM starts: its seams, the folder, the options, and
    the manifest against each rank's configuration. Raises :class:`ServeError` or
    :class:`~layouts.CompatibilityError` (one line)."""
    check_server_seams()
    args = parse_engine_args(argv)
    root = converted_root(args.model)
    if root is None:
        raise ServeError(f"--model {args.model}: not a folder prep converted (no {MANIFEST_NAME}); convert it with "
                         f"`prep convert {args.model} -o OUT --tp N`, or serve a source with "
                         f"`python -m {ATOM_SERVER}`")
    manifest = check_folder(root)
    check_options(args)
    check_draft(args, manifest)
    env = os.environ if env is None else env
    check_vocab_embed(manifest, env)
    # The server process asks no GPU (ATOM's does not import aiter, whose import builds its HIP
    # modules): without ``gpu_arch`` a rank passes here if some arch ATOM runs on reads the folder,
    # and each worker checks its own arch, as aiter reports it, before it allocates anything.
    archs = [gpu_arch] if gpu_arch else [PROFILE.default_gpu_arch] + [
        a.example for a in PROFILE.gpu_archs if a.example != PROFILE.default_gpu_arch]
    engines = []
    for rank in range(args.tensor_parallel_size):
        refusals = []
        for arch in archs:
            try:
                engines.append(engine_config(manifest, env, tp=args.tensor_parallel_size, rank=rank,
                                             expert_parallel=args.enable_expert_parallel, gpu_arch=arch))
                break
            except CompatibilityError as e:
                refusals.append(e)
        else:
            raise refusals[0]
    return root, manifest, engines


def main(argv: list[str] | None = None) -> int:
    """Check, then run ATOM's server on the same arguments, as ``python -m`` runs it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__.split("\n\nThe seams")[0])
        try:
            import_atom("atom.entrypoints.openai.api_server")
        except ServeError as e:
            print(f"\n{e}")
            return 0
        print(f"\nATOM's own options follow (python -m {ATOM_SERVER} --help).\n", flush=True)
    else:
        try:
            root, manifest, engines = check_start(argv)
        except (LayoutsError, CompatibilityError) as e:
            print(f"{PROG}: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
        e, t = engines[0], manifest.target
        print(f"{PROG}: {root}: TP {t.tp}, EP {t.ep}, layout {t.layout} (GEMM path {e.gemm_path}), MoE layout "
              f"{t.moe_layout} (MoE {e.moe_backend}): checked; each worker checks its rank and GPU arch again before "
              "loading; starting ATOM's server", file=sys.stderr)
        inject_runner()
    sys.argv = [ATOM_SERVER, *argv]
    runpy.run_module(ATOM_SERVER, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
