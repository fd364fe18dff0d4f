"""A page-cached file copied to a GPU by the DMA engine, with no CPU copy: the file is mapped, and
each chunk of the mapping is registered with the CUDA driver (pinned where it lies, read-only),
copied to the device and unregistered, by several threads at once, so that registering one
chunk overlaps copying others.

Only for a file that is already in memory (``mincore`` says at least :data:`RESIDENT` of its data
section is): registering a page not in the cache faults it in from the disk one readahead window
at a time, slower than the staged ``O_DIRECT`` reads of :mod:`layouts.device_load`. The calls go
to ``libcuda`` through ``ctypes`` (which releases the GIL; torch's bindings of the runtime do not),
each thread with its own stream in the device's primary context, where torch works too. Anything
the driver refuses makes :func:`copy_if_cached` return False before a byte is copied, and the
caller reads the file into staging instead.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import mmap
import os
import threading

import torch

from .safetensors_file import SafetensorsFile

PAGE = mmap.PAGESIZE
RESIDENT = 0.9
_READ_ONLY = 0x08  # CU_MEMHOSTREGISTER_READ_ONLY: the pages are only read by the device


class _Driver:
    """The few driver calls used here; None where there is no ``libcuda`` or a call is missing."""

    _lock = threading.Lock()
    _it: "_Driver | None | bool" = False

    @classmethod
    def get(cls) -> "_Driver | None":
        with cls._lock:
            if cls._it is False:
                try:
                    cls._it = cls()
                except (OSError, AttributeError):
                    cls._it = None
            return cls._it  # type: ignore[return-value]

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        sig = {"cuCtxGetCurrent": [ctypes.c_void_p], "cuCtxSetCurrent": [ctypes.c_void_p],
               "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
               "cuMemHostUnregister": [ctypes.c_void_p],
               "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
               "cuStreamSynchronize": [ctypes.c_void_p]}
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        self.lib = lib


class _Refused(Exception):
    pass


def _resident(base: int, length: int) -> float:
    """The fraction of ``length`` bytes mapped at ``base`` (page-aligned) that is in memory."""
    pages = -(-length // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(length), vec) != 0:
        return 0.0
    return sum(b & 1 for b in bytes(vec)) / pages


def copy_if_cached(sf: SafetensorsFile, out: torch.Tensor, threads: int, chunk: int) -> bool:
    """Copy ``sf``'s data section into ``out`` (a CUDA uint8 tensor of its size) straight from the
    page cache if it is there and the driver takes the registration; False (nothing copied)
    otherwise."""
    d = _Driver.get()
    if d is None or not sf.data_size:
        return False
    size = os.fstat(sf.fd).st_size
    if size != sf.data_offset + sf.data_size:
        return False  # the staged reader raises the clear error for it
    m = mmap.mmap(sf.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        base = _address(m)
        first = sf.data_offset // PAGE * PAGE
        if _resident(base + first, size - first) < RESIDENT:
            return False
        torch.cuda.init()
        with torch.cuda.device(out.device):
            ctx = ctypes.c_void_p()
            if d.lib.cuCtxGetCurrent(ctypes.byref(ctx)) or not ctx.value:
                return False
            spans = [(s, min(size, s + chunk)) for s in range(first, size, chunk)]
            streams = [torch.cuda.Stream(out.device) for _ in range(min(threads, len(spans)))]
            local = threading.local()
            counter = iter(range(len(streams)))
            lock = threading.Lock()

            def one(i: int) -> None:
                if not hasattr(local, "stream"):
                    if d.lib.cuCtxSetCurrent(ctx):
                        raise _Refused
                    with lock:
                        local.stream = streams[next(counter)].cuda_stream
                start, stop = spans[i]
                if d.lib.cuMemHostRegister_v2(ctypes.c_void_p(base + start), -(-(stop - start) // PAGE) * PAGE,
                                              _READ_ONLY):
                    raise _Refused
                try:
                    lo = max(start, sf.data_offset)
                    if (d.lib.cuMemcpyHtoDAsync_v2(out.data_ptr() + lo - sf.data_offset, ctypes.c_void_p(base + lo),
                                                   stop - lo, ctypes.c_void_p(local.stream))
                            or d.lib.cuStreamSynchronize(ctypes.c_void_p(local.stream))):
                        raise _Refused
                finally:
                    d.lib.cuMemHostUnregister(ctypes.c_void_p(base + start))

            try:
                with cf.ThreadPoolExecutor(len(streams), thread_name_prefix="prep-register") as pool:
                    list(pool.map(one, range(len(spans))))
            except _Refused:
                return False  # out may hold part of the file: the caller overwrites all of it
            return True
    finally:
        m.close()


def _address(m: mmap.mmap) -> int:
    """The address of a read-only mapping (ctypes' from_buffer wants a writable one)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about non-writable buffers; nothing writes here
        return torch.frombuffer(m, dtype=torch.uint8).data_ptr()
