"""The output folder of ``prep convert`` and ``prep revert``: the rules that keep a user's files
safe while prep writes, and the atomic swap that puts a finished output in place.

A 350 GiB source checkpoint is irreplaceable, so nothing is touched until these hold:

* OUT is not the input, does not contain it and does not lie inside it;
* OUT is absent, an empty folder, or (with ``--force``) a folder holding only files a previous
  prep run wrote there (its manifest or revert marker lists them): never a folder with one
  file prep did not write;
* no other prep process is writing OUT (an exclusive ``flock``; the second run is refused at
  once, naming the holder's pid).

Everything is built in a hidden work folder beside OUT, ``.OUT.prep/``::

    lock          flock'ed by the run in progress; holds its pid
    state.json    what is being built (kind, options) and, once swapping, the new manifest hash
    records/      one record per finished output file: its hashes and its sources' identities
    staging/      the new OUT, exactly as it will be (no record or scratch file inside)
    old/          the previous OUT while it is being deleted

Finishing swaps ``staging`` and OUT in one ``renameat2(RENAME_EXCHANGE)`` where the filesystem
allows it (two renames elsewhere), then deletes the previous OUT and the work folder. A kill at
any instant leaves either the previous or the new complete OUT at its path (with two renames:
recovered by the next run), and ``state.json`` says which phase was reached, so the next run
finishes or undoes exactly what was interrupted.

The checks on OUT itself are in :mod:`prep.out_check` (:class:`OutputFolder` extends its
``OutputPath``), which files of a folder are prep's in :mod:`prep.ownership`, and the file
operations a write is made of in :mod:`prep.fileops`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pathlib
import shutil
from typing import Any, Iterator

from layouts.manifest import COMPLETE_NAME, MANIFEST_NAME
from layouts.safe_files import MAX_JSON_BYTES, FileTooLargeError, read_regular

from .errors import PrepError
# the file operations a write is made of (each whole or not at all), and the fault suite's kill points
from .fileops import free_bytes, fsync_dir, kill_point, renamer, write_json
# whether prep may write OUT at all (not the input, only prep's files replaced): prep.out_check
from .out_check import OutputPath
# which files of a folder are prep's (what --force may replace): prep.ownership
from .ownership import PROBE_PREFIX, REVERT_MARKER, output_id, prep_files_in


class OutputFolder(OutputPath):
    """OUT of one ``prep convert`` / ``prep revert`` run: checked, locked, staged, swapped in.

    Use :meth:`check` before reading or planning anything expensive, then ``with
    out.locked():`` around the whole write; inside it :meth:`begin` prepares ``staging`` and
    :meth:`commit` puts it in place. :meth:`discard` removes the work folder after a failure
    that a resume cannot use (a full disk, bad input found late)."""

    def __init__(self, out: str | pathlib.Path, *, inputs: list[pathlib.Path], force: bool, flag: str = "-o"):
        super().__init__(out, inputs=inputs, force=force, flag=flag)
        self.staging = self.work / "staging"
        self.records = self.work / "records"
        self.old = self.work / "old"
        self.state_path = self.work / "state.json"
        self._lock_fd = -1
        self.notes: list[str] = []  # for the user, from the swap (see _give_back)

    # ------------------------------------------------------------------ checks
    def check_space(self, needed: int, skip: bool = False) -> None:
        """Refuse, before a byte is written, an output of ``needed`` bytes that OUT's filesystem
        cannot hold: its free space plus what an interrupted run left in staging (reused by
        ``--resume``, else discarded first). A previous output that ``--force`` replaces is
        deleted only after the new one is complete, so it frees nothing. ``skip``: --no-space-check."""
        if skip:
            return
        where = self.path
        while not where.exists() and where != where.parent:
            where = where.parent
        try:
            free = free_bytes(where)
        except OSError:
            return  # no answer from the filesystem: nothing to refuse on
        staged = sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(self.staging)
                     if e.is_file(follow_symlinks=False)) if self.staging.is_dir() else 0
        if needed > free + staged:
            raise PrepError(f"{self.flag} {self.given}: the output needs {needed / 2**30:.2f} GiB and its filesystem "
                            f"has {(free + staged) / 2**30:.2f} GiB free; free space, choose another output folder, or "
                            "pass --no-space-check")

    # ------------------------------------------------------------------ lock
    @contextlib.contextmanager
    def locked(self) -> Iterator["OutputFolder"]:
        """Hold the exclusive lock on OUT's work folder (refused at once if another prep holds it)."""
        self._acquire()
        try:
            yield self
        finally:
            self._release()

    def _acquire(self) -> None:
        while True:
            try:
                self.work.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.work / "lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError as e:
                raise PrepError(f"{self.flag} {self.given}: cannot write beside it in {self.work.parent} "
                                f"({e.strerror}); choose another output folder") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise PrepError(f"{self.flag} {self.given}: another prep process (pid {pid}) is writing it; wait "
                                "for it to finish or stop it") from None
            # The holder before us may have removed the lock file as it finished: a lock on an
            # unlinked file guards nothing, so take the one now at the path.
            try:
                same = os.stat(self.work / "lock").st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:  # a full disk before the first byte: leave nothing behind
            self._lock_fd = fd
            self._release()
            raise PrepError(f"{self.flag} {self.given}: cannot start writing beside it in {self.work.parent} "
                            f"({e.strerror}); free space or choose another output folder") from None
        self._lock_fd = fd

    def _release(self) -> None:
        fd, self._lock_fd = self._lock_fd, -1
        if fd < 0:
            return
        try:
            self.state_path.with_name("state.json.tmp").unlink(missing_ok=True)  # a state never written (disk full)
            if self.work.is_dir() and {e.name for e in os.scandir(self.work)} <= {"lock"}:  # kept/: the user's
                # Nothing left to resume or recover: remove the work folder, the lock last (while held).
                os.unlink(self.work / "lock")
                os.rmdir(self.work)
        except OSError:
            pass  # a leftover empty work folder is harmless; the next run reuses it
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any] | None:
        """The work folder's state; None where there is none, {} where it cannot be read as one
        (read as a regular file only, under the JSON bound: a FIFO there held convert, lock and
        all, forever)."""
        try:
            return json.loads(read_regular(self.state_path, MAX_JSON_BYTES))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, FileTooLargeError):
            return {}

    def recover(self) -> None:
        """Settle what a killed run left (under the lock), so that OUT holds one complete output
        and the work folder one known phase; what the user should hear goes to :attr:`notes`.

        ``swapping`` killed before the new output reached OUT goes back to ``building`` (staging
        is complete: a ``--resume`` reuses every file); killed after, it becomes ``swapped``
        with the previous output deleted (a ``--resume`` finds the output already complete)."""
        st = self.state()
        if st is None:
            left = {e.name for e in os.scandir(self.work)} - {"lock", "kept"} if self.work.is_dir() else set()
            if left <= {"staging", "records", "state.json.tmp"}:
                # What a run killed before its state was written leaves (or an earlier prep, which made
                # staging first): only prep's own partial work, which nothing can resume. Discarded.
                self.discard()
                return
            raise PrepError(f"{self.work}: holds {sorted(left)} but no state.json, so prep cannot tell what they are; "
                            "remove that folder yourself and run again")
        if st.get("phase") == "swapping":
            want = st.get("output_id")
            if want is not None and output_id(self.path) == want:
                self._set_phase(st, "swapped")
                self._delete_old()
                return
            elif want is not None and output_id(self.staging) == want:
                if not self.path.exists() and self.old.is_dir():
                    os.rename(self.old, self.path)  # two renames, killed between: the previous OUT goes back
                self._set_phase(st, "building")
                return
            else:
                raise PrepError(f"{self.work}: an interrupted swap left the new output neither at {self.path} nor "
                                "in staging; remove that folder yourself and convert again")
        if st.get("phase") == "swapped":
            self._delete_old()
            return
        if self.old.exists():  # cannot be, outside a swap; be safe: keep it for the user to look at
            raise PrepError(f"{self.old}: left by an interrupted run; remove it yourself and run again")

    def _set_phase(self, st: dict[str, Any], phase: str) -> None:
        write_json(self.state_path, {**st, "phase": phase})

    def begin(self, state: dict[str, Any], resume: bool) -> tuple[str | None, str | None]:
        """Prepare ``staging`` for a run with ``state`` (kind and options). Returns (kept, note).

        With ``resume``, an interrupted run with the same state is kept (the caller checks its
        finished files): ``kept`` is ``"building"``, or ``"swapped"`` when that run had already
        put its output at OUT (``state()["output_id"]`` names it). Any other leftover is
        discarded and ``note`` says so, for the user."""
        old = self.state()
        if old is not None and old.get("phase") in ("building", "swapped") and old.get("kind") == state.get("kind"):
            if resume:
                self._check_same_options(old, state)
                if old["phase"] == "swapped" or self.staging.is_dir():
                    return old["phase"], None
        note = None
        if old is not None and old.get("phase") == "building" and self.staging.is_dir():
            note = (f"discarded the unfinished run in {self.work}" +
                    (" (pass --resume to reuse its finished files)" if not resume else ""))
        self.discard()
        # The state first: a kill between these steps leaves a state with no (or empty) staging,
        # which the next run discards; staging before its state was a folder no run could read.
        write_json(self.state_path, {**state, "phase": "building"})
        kill_point("state-written")
        self.staging.mkdir(parents=True)
        self.records.mkdir()
        return None, note

    def _check_same_options(self, old: dict[str, Any], state: dict[str, Any]) -> None:
        opts_old, opts_new = old.get("options", {}), state.get("options", {})
        for k in sorted(set(opts_old) | set(opts_new)):
            if opts_old.get(k) != opts_new.get(k):
                raise PrepError(f"--resume: the interrupted run in {self.work} used {k}={opts_old.get(k)!r}, this "
                                f"one {k}={opts_new.get(k)!r}; rerun with the same options, or without --resume "
                                "to start over")
        if old.get("tool") != state.get("tool"):
            raise PrepError(f"--resume: the interrupted run was made by {old.get('tool')}, this is "
                            f"{state.get('tool')}; run without --resume to start over")

    @contextlib.contextmanager
    def discarded_on_error(self, keep_on_interrupt: bool, needed: str = "") -> Iterator[None]:
        """Run the write; on any error remove what it staged (on Ctrl-C too, unless
        ``keep_on_interrupt``: a resumable run keeps its finished files). A full disk becomes
        one line saying so (``needed``: how much the whole output takes). A resumable run keeps
        its finished files on a full disk and on a refusal at the swap (a file put into OUT
        meanwhile) as well, and says how to reuse them: an hour of converting is not thrown
        away for a disk that can be freed or a file that can be moved."""
        try:
            yield
        except KeyboardInterrupt as e:
            if self.swapped_in():  # stopped while the previous output's files were being deleted
                e.hint = self._swapped_note()
            elif not keep_on_interrupt:
                self.discard()
            raise
        except BaseException as e:
            swapped = self.swapped_in()
            full = isinstance(e, OSError) and e.errno == errno.ENOSPC
            keep = keep_on_interrupt and not swapped and (full or getattr(e, "keep_work", False))
            if not swapped and not keep:
                self.discard()
            kept = (f"; the finished files are kept in {self.work}: run the same command with --resume to reuse "
                    f"them (or remove that folder)") if keep else ""
            if full:
                if swapped:
                    raise PrepError(f"{self.flag} {self.given}: disk full after the swap; {self._swapped_note()}") \
                        from None
                raise PrepError(f"{self.flag} {self.given}: disk full while writing{needed}; free space or choose "
                                "another output folder" + (kept or "; partial output removed")) from None
            if keep:
                raise PrepError(f"{e}{kept}") from None
            raise

    def swapped_in(self) -> bool:
        """Whether OUT already holds this run's new output (its swap is done; what is left is
        deleting the previous output's files)."""
        st = self.state() or {}
        return st.get("phase") in ("swapping", "swapped") and st.get("output_id") is not None \
            and output_id(self.path) == st["output_id"]

    def _swapped_note(self) -> str:
        return (f"{self.given} already holds the new output, complete; the previous output's remaining files in "
                f"{self.old} are removed by the next prep run on it")

    def discard(self, final: bool = False) -> None:
        """Remove everything this run or an earlier one staged (the work folder is prep's own:
        created by :meth:`_acquire` under a name of prep's), keeping the lock; the state last,
        so that a kill in between leaves a state that says what is left (``final``: the clean-up
        after a swap, whose state a ``--resume`` reads)."""
        for p in (self.staging, self.records):
            shutil.rmtree(p, ignore_errors=True)
            if final and p is self.records:
                kill_point("final-records-removed")
        if self.old.exists() and not os.path.lexists(self.path):
            # the previous OUT, moved aside by a swap that failed before the new one took its place:
            # it goes back (never deleted here: only _delete_old deletes, and only prep's files)
            os.rename(self.old, self.path)
        self.state_path.unlink(missing_ok=True)
        if final:
            kill_point("final-state-removed")
        self.state_path.with_name("state.json.tmp").unlink(missing_ok=True)

    # ------------------------------------------------------------------ swap
    def commit(self) -> None:
        """Put the finished ``staging`` (its manifest and marker written) in place of OUT,
        atomically, and delete the previous OUT."""
        try:
            self.check_replaceable()  # again: a file may have been put into OUT while we converted
        except PrepError as e:
            e.keep_work = True  # staging is complete: a --resume once it is moved away reuses every file
            raise
        new_id = output_id(self.staging)
        if new_id is None:
            raise RuntimeError(f"{self.staging}: committed before its completion marker was written")
        write_json(self.state_path, {**(self.state() or {}), "phase": "swapping", "output_id": new_id})
        kill_point("swap-state-written")
        self._swap_in()
        try:
            self._finish()
        except KeyboardInterrupt as e:  # the new output is in place, whatever state the clean-up reached
            e.hint = self._swapped_note()
            raise

    def _swap_in(self) -> None:
        p = self.path
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.is_dir() and not any(os.scandir(p)):
            p.rmdir()  # an empty folder: replaced by a plain rename
        if p.exists():
            if os.environ.get("PREP_TEST_NO_EXCHANGE") or not renamer.exchange(self.staging, p):
                # No atomic exchange here: the previous OUT moves aside first. A kill between the
                # two renames leaves state "swapping", which the next run's recover() completes.
                os.rename(p, self.old)
                kill_point("moved-aside")
                os.rename(self.staging, p)
            else:
                kill_point("exchanged")
                os.rename(self.staging, self.old)  # staging now holds the previous OUT
        else:
            os.rename(self.staging, p)
        fsync_dir(p.parent)

    def _finish(self) -> None:
        st = self.state() or {}
        self._set_phase(st, "swapped")
        self._delete_old()
        self.discard(final=True)

    def _delete_old(self) -> None:
        """Delete the previous output, now in ``old``: only the files its own manifest or revert
        marker names as prep's (side files only while they hold prep's bytes), those markers last
        so that a kill in between leaves them to say what is left. Anything else was put into OUT
        while prep worked (after its last check): it goes back into OUT beside the new output, or,
        where the new output holds that name, stays in the work folder's ``kept/``; each says so."""
        if self.staging.exists():  # an exchange that was interrupted before the move to old/
            os.rename(self.staging, self.old)
        if not self.old.is_dir():
            return
        kill_point("old-moved")
        markers = (MANIFEST_NAME, COMPLETE_NAME, REVERT_MARKER)
        try:
            own = prep_files_in(self.old)
        except PrepError:
            own = None
        if own is None:  # killed between deleting the markers: they are all of prep's that is left
            own = set(markers)
        entries = sorted(os.scandir(self.old), key=lambda e: (e.name in markers, e.name == COMPLETE_NAME, e.name))
        for i, entry in enumerate(entries):
            if entry.name in own and entry.is_file(follow_symlinks=False):
                try:
                    os.unlink(entry.path)
                except OSError as e:  # immutable, or a read-only mount: the new output is in place all the same
                    raise PrepError(f"{self.given} holds the new output, complete; the previous output's "
                                    f"{entry.name} cannot be deleted from {self.old} ({e.strerror}): make it "
                                    f"deletable (e.g. chattr -i) and remove {self.old} yourself") from None
                if i == 0:
                    kill_point("old-half-deleted")
                if entry.name == MANIFEST_NAME:
                    kill_point("old-manifest-deleted")  # only the completion marker left of it
            elif entry.name.startswith(PROBE_PREFIX) and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)  # our own write check, from a killed run
            else:
                self._give_back(entry.name)
        os.rmdir(self.old)

    def _give_back(self, name: str) -> None:
        """Return ``name``, found in the previous output but not prep's, to OUT (or to ``kept/``
        where the new output has that name), and say where it is."""
        if not os.path.lexists(self.path / name):
            os.rename(self.old / name, self.path / name)
            self.notes.append(f"{name!r} was put into {self.given} while prep wrote it; kept there beside the new "
                              "output")
            return
        kept = self.work / "kept"
        kept.mkdir(exist_ok=True)
        os.rename(self.old / name, kept / name)
        self.notes.append(f"{name!r} was put into {self.given} while prep wrote it, and the new output has a file of "
                          f"that name: kept at {kept / name}; move it where you want it")
