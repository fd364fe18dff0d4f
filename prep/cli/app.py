"""The ``prep`` command's frame: the ``main`` group, one-line errors (``--json``, ``--debug``), the
option types every verb shares, and :func:`run`, the entry point. The verbs are in
:mod:`prep.cli.checkpoints` and :mod:`prep.cli.reference`."""


from __future__ import annotations

import functools
import json
import os
import pathlib
import sys
from typing import Any, Callable

import click

from .. import __version__
from ..errors import PrepError


_DEBUG = {"on": bool(os.environ.get("PREP_DEBUG"))}


def error_line(e: BaseException) -> str:
    """One line that says what went wrong and what to do, for any error that reaches the CLI."""
    import errno

    from layouts import CompatibilityError
    from layouts.errors import LayoutsError

    if isinstance(e, (PrepError, LayoutsError, CompatibilityError)):
        msg = str(e)
    elif isinstance(e, OSError):
        where = e.filename or "a file"
        if e.errno == errno.ENOSPC:
            msg = f"{where}: disk full; free space or write elsewhere"
        elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            msg = f"{where}: cannot write or read it ({e.strerror}); choose another folder or fix its permissions"
        else:
            msg = f"{where}: {e.strerror or e}"
    elif isinstance(e, MemoryError):
        msg = "out of memory; the input asks for more than this machine has (a damaged or hostile file?)"
    elif isinstance(e, RecursionError):
        msg = "input nested too deeply to be a checkpoint file; the file is damaged or hostile"
    else:
        msg = (f"internal error ({type(e).__name__}: {e}); rerun with prep --debug for the traceback and report it")
    return " ".join(msg.split())  # one line, whatever the message held


_INTERRUPTED = {  # what to tell the user after Ctrl-C, by command
    "convert": "finished files are kept in the hidden folder .OUT.prep beside OUT; rerun the same command "
               "with --resume to continue (or without it to start over and discard them)",
    "revert": "nothing was written to DEST; its partial copy was removed",
}


def _fail_cleanly(fn: Callable) -> Callable:
    """Every error becomes one line (``error: ...`` on stderr, or a JSON object on stdout with
    ``--json``) and exit code 1; Ctrl-C exits 130. ``prep --debug`` shows the traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = bool(kwargs.get("as_json"))
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt as e:
            msg = getattr(e, "hint", None) or _INTERRUPTED.get(fn.__name__, "stopped")
            if as_json:
                click.echo(json.dumps({"ok": False, "error": msg, "code": 130, "interrupted": True}))
            else:
                click.echo(f"interrupted: {msg}", err=True)
            sys.exit(130)
        except BrokenPipeError:
            # Whoever read prep's output went away (`prep inspect X | head -1`): no error line about
            # "a file", but the quiet end of a process its reader closed: 128 + SIGPIPE, and the
            # rest of its output (and Python's flush at exit) into nothing.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(141)
        except Exception as e:
            if _DEBUG["on"]:
                raise
            line = error_line(e)
            if as_json:
                click.echo(json.dumps({**(getattr(e, "result", None) or {}), "ok": False, "error": line, "code": 1}))
            else:
                click.echo(f"error: {line}", err=True)
            sys.exit(1)

    return wrapper


def _emit(result: dict[str, Any], as_json: bool, lines: list[str]) -> None:
    """The verb's result: one JSON object with ``"ok": true`` (an error is one object with
    ``"ok": false``, see :func:`_fail_cleanly`), or its lines."""
    if as_json:
        click.echo(json.dumps({"ok": True, **result}, indent=1))
    else:
        for line in lines:
            click.echo(line)


class _FromLayouts(click.Choice):
    """A choice among names that ``layouts`` states (the layout registry, the engine profile),
    read when click first needs them rather than when the CLI is imported: importing layouts
    (torch) takes seconds, which ``prep --help`` and ``prep --version`` should not pay."""

    def __init__(self, names: Callable[[], list[str]]):
        self._names = names
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self._names())

    @choices.setter
    def choices(self, _eager: Any) -> None:  # click.Choice.__init__ assigns the empty list given above
        pass


class _Default:
    """An option default read when used (click calls it) or shown in ``--help`` (``str``), for
    the same reason."""

    def __init__(self, value: Callable[[], str]):
        self._value = value

    def __call__(self) -> str:
        return self._value()

    def __str__(self) -> str:
        return self._value()


def _layout_names(kind: str) -> Callable[[], list[str]]:
    def names() -> list[str]:
        import layouts

        return layouts.layout_names(kind)

    return names


# What --engine means when omitted: the CLI is where the engine is chosen, and passes its profile
# on; nothing below it has a default engine. ``prep run`` reads a source with its GEMM paths.
DEFAULT_ENGINE = "atom"


def _default_engine() -> "layouts.EngineProfile":
    import layouts

    return layouts.get_engine(DEFAULT_ENGINE)


@functools.cache
def _default_target() -> "layouts.manifest.Target":
    """The conversion target of the CLI's default engine (its default configuration)."""
    from ..deepseek import target_for

    return target_for(_default_engine())


def _target_default(field: str) -> _Default:
    return _Default(lambda: getattr(_default_target(), field))


def _gemm_paths() -> list[str]:
    return list(_default_engine().gemm_paths)


class _PrepGroup(click.Group):
    """click's group, with its usage errors (a bad option, a missing argument) printed as
    every other error of prep: one line, ``error: ...`` on stderr or a JSON object on stdout
    when ``--json`` was given; the exit status stays click's 2 (a usage error, not a failed run)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Abort:  # Ctrl-C while click itself was reading the command line
            click.echo("interrupted: stopped", err=True)
            sys.exit(130)
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)
            where = f" (see {' '.join(['prep', *ctx.command_path.split()[1:]])} --help)" if ctx is not None else ""
            line = " ".join(e.format_message().split()) + where
            if "--json" in argv:
                click.echo(json.dumps({"ok": False, "error": line, "code": e.exit_code}))
            else:
                click.echo(f"error: {line}", err=True)
            sys.exit(e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)  # --help and --version return 0


def _existing_dir(path: str, what: str) -> str:
    """``path`` if it is a folder; else the one-line error every verb gives for a missing input."""
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        from ..out_check import WORK_SUFFIX

        if p.with_name(f".{p.name}{WORK_SUFFIX}").is_dir():  # an interrupted convert's work folder
            raise PrepError(f"{path}: no such directory yet: a `prep convert` into it was interrupted (its work is in "
                            f".{p.name}{WORK_SUFFIX} beside it); run the same convert command again with --resume")
        raise PrepError(f"{path}: no such directory; {what}")
    if not p.is_dir():
        raise PrepError(f"{path}: not a directory; {what}")
    return path


_CONVERTED = "give the folder prep convert wrote"


def _checkpoint_dir(src: str) -> str:
    """A folder to run: ``src`` itself, or a Hugging Face repo id (``org/name``, not a path
    that exists) resolved through huggingface_hub's cache as ``convert`` resolves its source."""
    p = pathlib.Path(src).expanduser()
    if not p.exists() and src.count("/") == 1 and not src.startswith((".", "/", "~")):
        from ..source import resolve

        return str(resolve(src)[0])
    return _existing_dir(src, "give a Quark source folder (or its Hugging Face repo id) or a folder prep convert wrote")


def _quiet_option(fn: Callable) -> Callable:
    return click.option("-q", "--quiet", is_flag=True,
                        help="No progress on stderr: neither the bar (on a terminal, not with --json) nor the "
                             "line every 10 s (PREP_PROGRESS_SECONDS) where stderr is a file or pipe.")(fn)


@click.group(cls=_PrepGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="prep")
@click.option("--debug", is_flag=True, help="Show the traceback of an error (also: PREP_DEBUG=1).")
def main(debug: bool) -> None:
    """Rewrite MXFP4 (AMD Quark) and FP8 DeepSeek checkpoints into the exact layouts AMD's kernels read.

    \b
    Typical use:
      prep inspect amd/DeepSeek-R1-0528-MXFP4
      prep convert amd/DeepSeek-R1-0528-MXFP4 -o r1-tp8 --layout preshuffle --tp 8
      prep verify r1-tp8 --source amd/DeepSeek-R1-0528-MXFP4
      prep revert r1-tp8 -o r1-roundtrip
    """
    if debug:
        _DEBUG["on"] = True


def run() -> None:
    """The ``prep`` command (and ``python -m prep``): :data:`main`, then out of the process at
    once, skipping the interpreter's shutdown.

    Why: finalizing torch's modules at exit took 0.25-0.3 s after ``import torch`` alone, and
    0.3-0.45 s after a conversion had written, fsynced and renamed everything (docs/BENCHMARKS.md):
    9% of a 5 GiB conversion on two cores, a third of ``prep convert --help``. By the time
    ``main`` returns, every verb has closed its files and joined its threads (a Ctrl-C or an
    error included: their clean-up runs inside ``main``); stdout and stderr are flushed here.
    An exception ``main`` does not turn into an exit status leaves the normal way, traceback
    and all. Tests call ``main`` (click's runner), never this."""
    try:
        main(prog_name="prep")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): what the interpreter does with it
            print(e.code, file=sys.stderr)
            code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (`prep ... | head -1`) or a closed stream
            pass
    os._exit(code)
