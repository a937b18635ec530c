"""ferry: move data between files, ferry:// servers, host memory and GPU memory.

    import ferry, torch
    with ferry.open("/data/shard-0.bin") as f:                  # or "ferry://host:7070/shard-0.bin"
        t = torch.empty(f.size, dtype=torch.uint8, device="cuda:0")
        f.read_into(t)                                         # straight into GPU memory
    state = ferry.safetensors.load("model.safetensors", device="cuda:0")

Buffers are torch tensors, objects with ``__cuda_array_interface__`` or the buffer protocol (numpy
arrays, bytearray), contiguous. Errors are ``ferry.Error`` with ferry's message and its ``code``.
Every call has a deadline: ``timeout=`` seconds (else ``FERRY_DEADLINE``) without a byte moving. Settings come from the
``FERRY_*`` environment variables; ``ferry.settings()`` shows them.
"""
from __future__ import annotations

import operator
import os
import threading
from typing import Any, Iterable, Sequence

from . import _ferry
from ._buffers import Span, span_of, stream_device, stream_handle, sync_torch
from ._ferry import DeviceBuffer, Error

__all__ = ["Error", "FormatError", "ArgumentError", "File", "Batch", "DeviceBuffer", "open", "read_batch",
           "write_batch", "cp", "copy", "empty", "as_tensor", "settings", "runtime", "version", "safetensors", "transformers"]
__version__ = _ferry.version()


class FormatError(Error, ValueError):
    """A file that breaks its format (a safetensors header, an index): the message names the file, the tensor
    and the field. ``.code`` is ``"invalid_format"``."""


class ArgumentError(Error, ValueError):
    """An argument ferry cannot use (a path of the wrong type, a name that is not there, a shard rule that does
    not fit a tensor). ``.code`` is ``"invalid_argument"``."""

_lock = threading.Lock()
_runtime: _ferry.Runtime | None = None
_runtime_pid = 0
# A runtime belongs to the process that made it (its threads do not come along into a forked child):
# in a child, a fresh one is made on first use. The parent's, ended there, leaves its parts alone.


def _forked() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it


os.register_at_fork(after_in_child=_forked)


def runtime(**overrides: str) -> _ferry.Runtime:
    """The process's runtime, made on first use from the FERRY_* environment; ``overrides`` (FERRY_NAME="value")
    apply only to that first call."""
    global _runtime, _runtime_pid
    with _lock:
        if _runtime is None or _runtime_pid != os.getpid():  # none yet, or the parent's (a forked child)
            _runtime = _ferry.Runtime({k: str(v) for k, v in overrides.items()} if overrides else None)
            _runtime_pid = os.getpid()
        elif overrides:
            raise RuntimeError("ferry.runtime(): the runtime exists already; settings apply when it is made")
        return _runtime


def version() -> str:
    return _ferry.version()


def settings() -> dict[str, str]:
    """Every FERRY_* setting with the value this process uses."""
    return {name: value for name, value, _default, _doc in runtime().settings()}


class Batch:
    """Requests running in the background. ``wait()`` returns True when all succeeded; ``check()`` raises the
    first failure as ferry.Error; ``results()`` has every request's state, bytes and error. The buffers are
    kept alive until the batch is closed (``close()``, ``with``, or garbage collection, which waits for it)."""

    def __init__(self, impl: _ferry.Batch, keep: list[Any]):
        self._impl = impl
        self._keep = keep

    def wait(self, timeout: float | None = None) -> bool:
        return self._impl.wait(timeout)

    def done(self) -> bool:
        return self._impl.poll()

    def check(self) -> None:
        self._impl.wait(None)
        self._impl.check()

    def results(self) -> list[dict]:
        return self._impl.results()

    def cancel(self) -> None:
        self._impl.cancel()

    @property
    def bytes_done(self) -> int:
        return self._impl.bytes_done

    @property
    def bytes_total(self) -> int:
        return self._impl.bytes_total

    def close(self) -> None:
        self._impl.close()
        self._keep = []

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _device_of(spans: Sequence[Span]) -> str:
    for s in spans:
        if s.device.startswith("cuda"):
            return s.device
    return "cuda:0"


class File:
    """A file opened with ``ferry.open``: a local path or ``ferry://host:port/path``."""

    def __init__(self, impl: _ferry.File):
        self._impl = impl

    @property
    def path(self) -> str:
        return self._impl.path

    @property
    def size(self) -> int:
        return self._impl.size

    def read_into(self, buf: Any, offset: int = 0, *, nbytes: int | None = None, timeout: float | None = None) -> int:
        """Reads from ``offset`` into ``buf`` (its whole size, or ``nbytes``); returns the bytes read (short at the end
        of the file)."""
        s = span_of(buf, writable=True, what="read_into")
        n = _length(s, nbytes)
        sync_torch([s])
        return runtime().read(self._impl, offset, s.ptr, n, timeout)

    def write_from(self, buf: Any, offset: int = 0, *, nbytes: int | None = None, sync: bool = False,
                   timeout: float | None = None) -> None:
        """Writes ``buf`` (or its first ``nbytes``) at ``offset``; ``sync`` makes it durable before returning."""
        s = span_of(buf, writable=False, what="write_from")
        sync_torch([s])
        runtime().write(self._impl, offset, s.ptr, _length(s, nbytes), sync, timeout)

    def read_async(self, buf: Any, offset: int = 0, *, nbytes: int | None = None, stream: Any = None,
                   timeout: float | None = None) -> Batch:
        """A read in the background; with ``stream`` (torch/CuPy stream), in that stream's order: work queued on the
        stream before starts after nothing, work queued after sees the data, and no CPU waits for the stream."""
        return read_batch([(self, offset, buf, nbytes)], stream=stream, timeout=timeout)

    def write_async(self, buf: Any, offset: int = 0, *, nbytes: int | None = None, stream: Any = None,
                    timeout: float | None = None) -> Batch:
        return write_batch([(self, offset, buf, nbytes)], stream=stream, timeout=timeout)

    def sync(self) -> None:
        """Makes what was written durable; a ferry:// file's writes become visible (atomically) here."""
        self._impl.sync()

    def close(self) -> None:
        self._impl = None

    def __enter__(self) -> "File":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ferry.File({self.path!r})" if self._impl else "ferry.File(closed)"


def _byte_offset(offset: Any, what: str) -> int:
    """``offset`` as an int >= 0 (a numpy integer, say), or ArgumentError naming it."""
    try:
        at = operator.index(offset)
    except TypeError:
        at = -1
    if not 0 <= at < 1 << 64:
        e = ArgumentError(f"{what}: offset {offset!r} is not a byte offset (an int >= 0)")
        e.code = "invalid_argument"
        raise e
    return at


def _length(s: Span, nbytes: int | None) -> int:
    if nbytes is None:
        return s.nbytes
    try:
        nbytes = operator.index(nbytes)
    except TypeError:
        raise ValueError(f"nbytes={nbytes!r} is not a byte count (an int)") from None
    if nbytes < 0 or nbytes > s.nbytes:
        raise ValueError(f"nbytes={nbytes} is outside the buffer's {s.nbytes} bytes")
    return nbytes


def open(path: str | os.PathLike, mode: str = "r") -> File:  # noqa: A001 - the package's open, like io.open
    """Opens a local file (str or os.PathLike), ``ferry://host:port/path``, or an ``http://``, ``https://`` or
    ``s3://bucket/key`` URL (read, or 'w': put whole by one write); mode 'r', 'r+' or 'w' (create or truncate). Only regular files: a FIFO, socket or device is refused
    without blocking."""
    return File(runtime().open(_fspath(path), mode))


def _fspath(path: Any) -> str:
    if isinstance(path, (str, os.PathLike)):
        p = os.fspath(path)
        return os.fsdecode(p) if isinstance(p, bytes) else p
    e = ArgumentError(f"a path is a str or os.PathLike, not {type(path).__name__}")
    e.code = "invalid_argument"
    raise e


def _submit(columns, write: bool, spans, stream, timeout, after_torch: bool = True) -> Batch:
    """``columns``: the requests as (files, offsets, pointers, sizes), a list each."""
    handle = stream_handle(stream)
    if handle is None and after_torch:
        sync_torch(spans)  # without a stream, after what torch already queued
    device = (stream_device(stream) or _device_of(spans)) if handle is not None else ""
    impl = runtime().submit(*columns, write, handle, device, timeout)
    return Batch(impl, spans)


def _batch(requests: Iterable[tuple], write: bool, stream: Any, timeout: float | None, after_torch: bool = True) -> Batch:
    """``after_torch=False``: the caller knows no work torch queued uses the buffers (the loader's own buffers,
    made and waited for once), so the requests do not wait for torch's current streams first."""
    what = "write_batch" if write else "read_batch"
    files, offsets, ptrs, sizes, spans = [], [], [], [], []
    for r in requests:
        f, offset, buf = r[0], r[1], r[2]
        if not isinstance(f, File):
            raise TypeError(f"{what}: {type(f).__name__} is not a ferry.File")
        if type(offset) is not int or not 0 <= offset < 1 << 64:
            offset = _byte_offset(offset, f"{what} request {len(spans)}")
        s = span_of(buf, writable=not write, what=f"{what} request {len(spans)}")
        files.append(f._impl)
        offsets.append(offset)
        ptrs.append(s.ptr)
        sizes.append(_length(s, r[3]) if len(r) > 3 else s.nbytes)
        spans.append(s)
    return _submit((files, offsets, ptrs, sizes), write, spans, stream, timeout, after_torch)


def read_batch(requests: Iterable[tuple], *, stream: Any = None, timeout: float | None = None) -> Batch:
    """Many reads in one batch: an iterable of ``(file, offset, buf)`` or ``(file, offset, buf, nbytes)``."""
    return _batch(requests, False, stream, timeout)


def write_batch(requests: Iterable[tuple], *, stream: Any = None, timeout: float | None = None) -> Batch:
    """Many writes in one batch: an iterable of ``(file, offset, buf)`` or ``(file, offset, buf, nbytes)``. A file
    written this way is durable (and, for ferry://, visible) after ``file.sync()``."""
    return _batch(requests, True, stream, timeout)


def cp(src: str | os.PathLike, dst: str | os.PathLike, *, chunk: int = 64 << 20, timeout: float | None = None) -> int:
    """Copies the file ``src`` to ``dst`` (local paths or ferry:// URIs, any mix); returns the bytes copied.
    ``dst`` is created or replaced (a ferry:// destination appears whole when the copy is done); a local ``dst`` this
    call created is removed if the copy fails."""
    src, dst = _fspath(src), _fspath(dst)
    created = "://" not in dst and not os.path.lexists(dst)
    try:
        return _cp(src, dst, chunk, timeout)
    except BaseException:
        if created and os.path.lexists(dst):  # a failed copy leaves no destination it created
            os.unlink(dst)
        raise


def _cp(src: str, dst: str, chunk: int, timeout: float | None) -> int:
    import numpy as np

    if os.path.realpath(src) == os.path.realpath(dst) if "://" not in src + dst else src == dst:
        raise ValueError(f"ferry.cp: {src} is both the source and the destination")
    with open(src) as s, open(dst, "w") as d:
        size = s.size
        bufs = [np.empty(min(chunk, max(size, 1)), dtype=np.uint8) for _ in range(2)]
        off, i, pending = 0, 0, None
        while off < size:
            buf = bufs[i % 2]
            n = s.read_into(buf, off, nbytes=min(len(buf), size - off), timeout=timeout)
            if n == 0:
                e = Error(f"ferry.cp {src}: the file ended at {off} of {size} bytes (it shrank during the copy)")
                e.code = "io_error"
                raise e
            if pending is not None:
                pending.check()  # the write of the other buffer
                pending.close()
            pending = d.write_async(buf, off, nbytes=n, timeout=timeout)
            off += n
            i += 1
        if pending is not None:
            pending.check()
            pending.close()
        d.sync()
        return off


def copy(dst: Any, src: Any, *, timeout: float | None = None) -> None:
    """Copies ``src`` into ``dst`` (same size) between any two of host, pinned, GPU and ferry device memory."""
    d = span_of(dst, writable=True, what="copy dst")
    s = span_of(src, writable=False, what="copy src")
    if d.nbytes != s.nbytes:
        raise ValueError(f"copy: dst has {d.nbytes} bytes, src {s.nbytes}")
    sync_torch([d, s])
    runtime().copy(d.ptr, s.ptr, s.nbytes, timeout)


def empty(nbytes: int, device: str = "pinned"):
    """``nbytes`` of memory ferry makes, freed when the object and every tensor made over it are gone: ``"pinned"``
    host memory (page-locked; copies to and from GPUs go straight from it) or device memory ferry maps (``"cuda:0"``,
    ``"sim:0"``). Pinned and CUDA memory are exported with DLPack (``__dlpack__``) and the array interfaces:
    ``torch.from_dlpack(buf)``, ``numpy.from_dlpack(buf)`` or ``ferry.as_tensor(buf)`` make arrays without a copy."""
    if device in ("pinned", "cpu"):
        return runtime().alloc_pinned(nbytes)
    return runtime().alloc(device, nbytes)


def as_tensor(buf, dtype=None, shape=None):
    """A torch tensor over ferry's pinned or CUDA memory (no copy; it keeps ``buf`` alive): bytes, or ``dtype``
    elements in ``shape``. The same as ``torch.from_dlpack(buf)``: ferry's buffers export DLPack, so numpy, CuPy
    and JAX take them without a copy too."""
    import torch

    t = torch.from_dlpack(buf)
    if dtype is not None:
        t = t.view(dtype)
    return t.reshape(shape) if shape is not None else t


from . import safetensors  # noqa: E402  (uses the names above)
from . import torch  # noqa: E402  (ferry.torch: unified memory as torch's allocator; imports torch only when used)
from . import transformers  # noqa: E402  (ferry.transformers.from_pretrained; imports transformers only when used)
