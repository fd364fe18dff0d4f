"""One safetensors file, read with ``pread``: the header parsed and checked against the file size,
tensors read into fresh buffers (a block of rows at a time if asked) or the whole data section
read once, sequentially, and handed out as views.

The converter reads with ``pread`` into its own buffers: mapped pages that were read stay
resident and count against the process, which is how a converter ends up holding a whole
checkpoint. The runtime loader (``layouts.load_rank``) maps whole files instead
(:func:`map_all`): it hands the bytes on as they are, and mapped pages can be dropped under
memory pressure. Shared by the loader and by prep's converter, verifier and reverter.
"""

from __future__ import annotations

import errno
import mmap
import operator
import os
import pathlib
from typing import NamedTuple

import torch

from .errors import LayoutsError
from .safe_files import DuplicateKeyError, open_regular, strict_json

__all__ = [
    "TORCH_DTYPES", "ITEMSIZE", "READ_BLOCK", "DIRECT_ALIGN", "tensor_bytes", "file_xxh3",
    "tensor_hash", "SpanHasher", "SafetensorsFileError", "FileAccessError", "TensorInfo",
    "MAX_HEADER_BYTES", "SafetensorsFile", "map_all", "byte_view",
]

# safetensors dtype strings and the torch dtypes they are read into.
TORCH_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "BOOL": torch.bool, "BF16": torch.bfloat16,
                "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I16": torch.int16,
                "I32": torch.int32, "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
ITEMSIZE = {s: t.itemsize for s, t in TORCH_DTYPES.items()}  # bytes per element of each dtype string
READ_BLOCK = 64 << 20  # bytes per pread when a whole file is read
DIRECT_ALIGN = 4096  # O_DIRECT's unit for offsets, lengths and memory (512 or 4096 by device)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's raw bytes (little-endian, as safetensors stores them), without a copy when contiguous."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def _xxh3_128():
    """xxhash's xxh3-128 constructor. xxhash is optional for the runtime (mxfp4-layouts installs
    with torch alone; its ``hashes`` extra adds xxhash): without it, loading works and checking
    a hash says what to install."""
    try:
        import xxhash
    except ImportError:
        raise LayoutsError("checking tensor hashes needs xxhash, which is not installed: pip install "
                           "'mxfp4-layouts[hashes]' (or xxhash), or load without verify_hashes") from None
    return xxhash.xxh3_128


def file_xxh3(path: str | os.PathLike) -> str:
    """The xxh3-128 of a whole regular file (a side file: config, tokenizer), read 16 MiB at a time
    through the descriptor checked to be a regular file; LayoutsError where xxhash is missing."""
    h = _xxh3_128()()
    with os.fdopen(open_regular(path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def tensor_hash(t: torch.Tensor) -> str:
    """The xxh3-128 hex digest of the tensor's bytes: what the manifest records per tensor."""
    return _xxh3_128()(tensor_bytes(t)).hexdigest()


class SpanHasher:
    """xxh3-128 digests of named byte ranges of one stream that arrives in order, in blocks of any
    size: how a writer hashes each tensor on its way out, and a reader on one sequential pass.
    ``spans`` are (name, start, stop), ascending and not overlapping; bytes outside them (a
    header, a pad) are skipped."""

    def __init__(self, spans):
        self._new = _xxh3_128()
        self._spans = list(spans)
        self._i = 0  # the span in progress
        self._h = None
        self.digests: dict[str, str] = {}

    def feed(self, buf, start: int) -> None:
        """The stream's bytes ``buf`` (a bytes-like object) at stream offset ``start``."""
        stop = start + len(buf)
        while self._i < len(self._spans):
            name, a, b = self._spans[self._i]
            if a >= stop:
                return
            if self._h is None:
                self._h = self._new()
            lo, hi = max(a, start), min(b, stop)
            if hi > lo:
                self._h.update(buf[lo - start:hi - start])
            if b > stop:
                return
            self.digests[name] = self._h.hexdigest()
            self._h = None
            self._i += 1

    def finish(self) -> dict[str, str]:
        """Every digest, once the whole stream was fed (empty spans at its very end included)."""
        while self._i < len(self._spans):
            self.digests[self._spans[self._i][0]] = (self._h or self._new()).hexdigest()
            self._h = None
            self._i += 1
        return self.digests


class SafetensorsFileError(LayoutsError):
    """The file is not a whole, readable safetensors file (truncated, corrupt, or changed)."""


class FileAccessError(SafetensorsFileError):
    """A file this process may not read (permissions): its fix is access, not a new copy."""


class TensorInfo(NamedTuple):
    """Where one tensor lies in its file. A named tuple: a checkpoint has ~90k of them, and
    building them is most of the time a header takes to parse."""

    name: str
    file: str  # file name, relative to the checkpoint folder
    dtype: str  # safetensors dtype string: "U8", "BF16", "F32", ...
    shape: tuple[int, ...]
    offset: int = 0  # absolute byte offset of the data in the file
    nbytes: int = 0


def _printable(v) -> str:
    """``v`` for a one-line message: as is when it is a printable string, else its repr."""
    return v if isinstance(v, str) and v.isprintable() else repr(v)


_BY_SPAN = operator.itemgetter(4, 5)  # a TensorInfo's (offset, nbytes): empty tensors first at an offset
# What a header may take, well above what a real checkpoint needs: the largest in R1-0528's 76
# shards is 154 KB, the largest prep writes for it 101 KB (TP 8, measured on the r1-count preset),
# and a header costs ~28x its size in memory to parse (a 94 MB one: 3.8 s, 0.9 GiB over the
# interpreter's; 16 MiB: 0.5 s, 0.15 GiB). The safetensors library itself accepts 100 MB.
MAX_HEADER_BYTES = 16 << 20


class SafetensorsFile:
    """A safetensors file opened for ``pread``. ``tensors`` maps name -> :class:`TensorInfo`.

    Everything the header says is checked against the file before anything is allocated or
    looped over: a regular file (a FIFO would block the open forever), a header within the file
    and the format's limit, strict UTF-8 JSON with no key twice, every entry typed as the format
    says, no dimension larger than the file (``[2**62, 0]`` is 0 bytes yet loops 2**62 rows
    downstream), and the tensors' bytes covering the data section exactly: no overlap, no gap."""

    def __init__(self, path: str | pathlib.Path):
        import gc

        self.path = path = pathlib.Path(path)
        self.fd = -1
        try:
            self.fd = open_regular(path)
            size = os.fstat(self.fd).st_size
            head = os.pread(self.fd, 8, 0)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 0 or 8 + n > size:
                raise ValueError("header length beyond the end of the file")
            if n > MAX_HEADER_BYTES:
                raise SafetensorsFileError(f"{path}: a header of {n} bytes, over prep's bound of {MAX_HEADER_BYTES >> 20} "
                                           "MiB (real DeepSeek shards hold under 0.2 MB); this is not a checkpoint "
                                           "prep can read")
            raw = os.pread(self.fd, n, 8)
            if len(raw) != n:
                raise ValueError("short read of the header")
            header = strict_json(raw)  # timing: see strict_json
        except (FileNotFoundError, SafetensorsFileError):
            raise
        except PermissionError as e:  # the file may be fine: the fix is not a new copy of it
            raise FileAccessError(f"{path}: cannot be read ({e.strerror}); check its permissions") from None
        except DuplicateKeyError as e:
            raise SafetensorsFileError(f"{path}: the header names {e.key!r} twice; the file is corrupt") from None
        except (OSError, ValueError) as e:
            raise SafetensorsFileError(f"{path}: unreadable safetensors file ({str(e).splitlines()[0]}); the file is "
                                       "truncated or corrupt") from None
        self.data_offset = base = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict = {}  # the header's "__metadata__" (strings to strings, by the format)
        if not isinstance(header, dict):
            raise SafetensorsFileError(f"{path}: the header is not a JSON object; the file is corrupt")
        fname, tensors, itemsize = path.name, self.tensors, ITEMSIZE
        paused = gc.isenabled()  # see strict_json: ~61k named tuples are built here too
        gc.disable()
        try:
            for name, meta in header.items():  # the hot loop of opening a checkpoint: kept lean
                if name == "__metadata__":
                    self.metadata = meta if isinstance(meta, dict) else {}
                    continue
                if not name.isprintable():  # messages name tensors, on one line
                    raise SafetensorsFileError(f"{path}: tensor name {name!r} holds control characters; the file is corrupt")
                try:
                    a, b = meta["data_offsets"]
                    dtype, shape = meta["dtype"], tuple(meta["shape"])
                    nb = itemsize.get(dtype)
                    if type(a) is not int or type(b) is not int or type(meta["shape"]) is not list:
                        raise TypeError  # JSON integers and lists only: not 1.0, true, "8" or a string's letters
                    for d in shape:
                        if type(d) is not int:
                            raise TypeError
                except (KeyError, TypeError, ValueError, AttributeError):
                    raise SafetensorsFileError(f"{path}: header entry of {name} is malformed; the file is corrupt") from None
                if nb is None:
                    raise SafetensorsFileError(f"{path}: tensor {name} has dtype {_printable(dtype)}, which this reader does not "
                                               f"know (known: {', '.join(TORCH_DTYPES)})")
                for d in shape:
                    nb *= d
                if nb != b - a or a < 0 or (shape and (min(shape) < 0 or max(shape) > size)):
                    if shape and max(shape) > size and min(shape) >= 0:
                        raise SafetensorsFileError(f"{path}: tensor {name} has shape {list(shape)}, a dimension larger "
                                                   f"than the file's {size} bytes; the file is corrupt")
                    raise SafetensorsFileError(f"{path}: tensor {name} is {dtype} {list(shape)} but spans bytes [{a}, {b}); "
                                               "the file is corrupt")
                tensors[name] = TensorInfo(name, fname, dtype, shape, base + a, b - a)
            # The format wants the data section covered exactly, in any order: a byte of two tensors
            # or of none means a damaged or crafted file (and a key given twice shows up here too
            # when the parser is lenient). Files are written in order: the sort is one pass.
            pos, prev = base, None
            for t in sorted(tensors.values(), key=_BY_SPAN):
                if t.offset != pos:
                    what = f"overlaps {prev.name} [{prev.offset - base}, {pos - base})" if t.offset < pos else \
                        f"leaves bytes [{pos - base}, {t.offset - base}) of the data section to no tensor"
                    raise SafetensorsFileError(f"{path}: tensor {t.name} at bytes [{t.offset - base}, "
                                               f"{t.offset - base + t.nbytes}) {what}; the file is corrupt")
                pos += t.nbytes
                prev = t
        finally:
            if paused:
                gc.enable()
        self.data_size = end = pos - base
        if 8 + n + end != size:
            raise SafetensorsFileError(f"{path}: file is {size} bytes but its header says {8 + n + end}; "
                                       "the file is truncated or corrupt")

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)

    def _pread_into(self, buf, offset: int, what: str) -> None:
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:done + READ_BLOCK]], offset + done)
            if got <= 0:
                raise SafetensorsFileError(f"{self.path}: short read of {what}; the file changed or is truncated")
            done += got

    def read(self, info: TensorInfo, rows: slice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, or a contiguous block of its rows, read straight into a new tensor (or
        into ``out``, a contiguous tensor of that shape and dtype: no intermediate copy)."""
        shape = list(info.shape)
        row_bytes = info.nbytes // shape[0] if shape and shape[0] else info.nbytes
        start, stop = (0, shape[0] if shape else 1) if rows is None else \
            (rows.start or 0, shape[0] if rows.stop is None else rows.stop)
        if shape:
            if not 0 <= start <= stop <= info.shape[0]:
                raise ValueError(f"read {info.name}: rows [{start}, {stop}) outside its {info.shape[0]} rows")
            shape[0] = stop - start
        if out is None:
            out = torch.empty(shape, dtype=TORCH_DTYPES[info.dtype])
        elif list(out.shape) != shape or out.dtype != TORCH_DTYPES[info.dtype] or not out.is_contiguous():
            raise ValueError(f"read {info.name}: out is {list(out.shape)} {out.dtype}, wants contiguous {shape}")
        if out.numel():
            self._pread_into(out.view(-1).view(torch.uint8).numpy(), info.offset + start * row_bytes, info.name)
        return out

    def get(self, name: str) -> torch.Tensor:
        """A whole tensor by name (KeyError if the file has none)."""
        return self.read(self.tensors[name])

    def hash_tensors(self, names=None, stop=None) -> dict[str, str]:
        """xxh3-128 of every tensor (or of those in ``names``; KeyError for one the file lacks),
        in one sequential pass over the data section: the next block is read while this one is
        hashed (both release the GIL), so a checkpoint is checked at about disk speed instead
        of one read and one hash after the other per tensor. ``stop`` (a ``threading.Event``):
        once set, the pass ends at its next block and what it returns is incomplete."""
        import concurrent.futures as cf

        infos = sorted((self.tensors[n] for n in (self.tensors if names is None else names)), key=lambda t: t.offset)
        hasher = SpanHasher((t.name, t.offset, t.offset + t.nbytes) for t in infos)
        if infos:
            start, end = infos[0].offset, max(t.offset + t.nbytes for t in infos)
            bufs = [bytearray(READ_BLOCK), bytearray(READ_BLOCK)]

            def read(i: int, offset: int) -> memoryview:
                view = memoryview(bufs[i])[:min(READ_BLOCK, end - offset)]
                self._pread_into(view, offset, "the data section")
                return view

            with cf.ThreadPoolExecutor(1, thread_name_prefix="read-ahead") as pool:
                pending, i = pool.submit(read, 0, start), 0
                for offset in range(start, end, READ_BLOCK):
                    view = pending.result()
                    if stop is not None and stop.is_set():
                        return {}
                    if offset + READ_BLOCK < end:
                        pending = pool.submit(read, 1 - i, offset + READ_BLOCK)
                    hasher.feed(view, offset)
                    i = 1 - i
        return hasher.finish()

    def read_all(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The whole data section in one sequential read, and every tensor as a view into it.

        One buffer and a few large reads instead of one allocation and read per tensor: what
        makes loading thousands of tensors run at disk speed. The views keep the buffer alive."""
        buf = torch.empty(self.data_size, dtype=torch.uint8)
        if self.data_size:
            self._pread_into(buf.numpy(), self.data_offset, "the data section")
        return buf, self.views(buf)

    def read_direct(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Like :meth:`read_all`, with ``O_DIRECT``: the whole file in large aligned reads from the
        disk into page-aligned memory, past the page cache (a 350 GiB load gains nothing from it
        and evicts everything else), at the disk's speed cold. Reads the checked file itself (its
        descriptor reopened through ``/proc/self/fd``, never the path). Where ``O_DIRECT`` is
        refused (tmpfs, some network filesystems, no ``/proc``) it is :meth:`read_all`."""
        fd = self.direct_fd()
        if fd is None:
            return self.read_all()
        try:
            size = os.fstat(fd).st_size
            if size != self.data_offset + self.data_size:
                raise SafetensorsFileError(f"{self.path}: file is {size} bytes, {self.data_offset + self.data_size} "
                                           "when its header was read; it changed while being loaded: load it again")
            span = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN  # O_DIRECT reads whole aligned blocks
            flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
            mem = mmap.mmap(-1, max(span, DIRECT_ALIGN), flags=flags) if flags else mmap.mmap(-1, max(span, DIRECT_ALIGN))
            view, done = memoryview(mem), 0
            try:
                while done < size:
                    got = os.preadv(fd, [view[done:min(span, done + READ_BLOCK)]], done)
                    if got <= 0:
                        raise SafetensorsFileError(f"{self.path}: short read; the file changed or is truncated")
                    done += got
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                view.release()
                return self.read_all()  # the filesystem took the open but not the reads
            view.release()
        finally:
            os.close(fd)
        whole = torch.frombuffer(mem, dtype=torch.uint8)
        buf = whole[self.data_offset:self.data_offset + self.data_size]
        return buf, self.views(buf)

    def direct_fd(self) -> int | None:
        """This checked file opened again with ``O_DIRECT`` (through ``/proc/self/fd``, never the
        path), for the caller to close; None where that is not possible."""
        flag = getattr(os, "O_DIRECT", 0)
        proc = pathlib.Path(f"/proc/self/fd/{self.fd}")
        if not flag or not proc.exists():
            return None
        try:
            return os.open(proc, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every tensor as a view into ``buf``, a copy of the data section (on any device)."""
        return {name: byte_view(buf, info.offset - self.data_offset, info.nbytes, TORCH_DTYPES[info.dtype], info.shape)
                for name, info in self.tensors.items()}


def map_all(sf: "SafetensorsFile") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Like :meth:`SafetensorsFile.read_all`, but the file is memory-mapped (copy-on-write), not
    read: no copy and no anonymous memory, pages come from the page cache on first touch and can
    be dropped again under pressure (what ``safe_open`` does). The fast path for loading to a
    GPU (each file staged from the mapping through pinned blocks) and for CPU engines.

    It maps the descriptor the header was checked through, never the path again: a file renamed
    over that path in between (another conversion's swap, a hostile one) cannot put unchecked
    bytes behind the checked header."""
    size = os.fstat(sf.fd).st_size
    if size != sf.data_offset + sf.data_size:
        raise SafetensorsFileError(f"{sf.path}: file is {size} bytes, {sf.data_offset + sf.data_size} when its header "
                                   "was read; it changed while being loaded: load it again")
    # ACCESS_COPY: a private mapping (pages shared with the page cache until written, writes
    # never reach the file), writable so torch takes it without a copy or a warning.
    whole = torch.frombuffer(mmap.mmap(sf.fd, size, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    buf = whole[sf.data_offset:sf.data_offset + sf.data_size]
    return buf, sf.views(buf)


def byte_view(buf: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """``buf[offset:offset+nbytes]`` (uint8) seen as ``dtype`` / ``shape``; a copy only when the
    offset is not aligned to the dtype (safetensors does not promise alignment)."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=buf.device)
    t = buf[offset:offset + nbytes]
    if t.data_ptr() % dtype.itemsize:  # the address, not the offset: a mapped data section may start unaligned
        t = t.clone()
    return t.view(dtype).view(shape)
