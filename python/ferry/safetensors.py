"""safetensors checkpoints straight into their final memory.

``load(path, device)`` takes a ``.safetensors`` file, a Hugging Face folder of shards or its
``*.safetensors.index.json`` (local paths, ``os.PathLike`` or ``ferry://`` URIs). It reads every header, checks it
as strictly as safetensors does, makes each tensor where it belongs and reads all their bytes, across every shard,
as one batch of the file engine: no copy of the checkpoint in host memory. On the CPU the tensors are the file's
pages themselves (a private, copy-on-write mapping, as safetensors does), unless ``mmap=False``.

``safe_open(path, framework="pt", device=...)`` is safetensors' lazy handle: ``keys()``, ``metadata()``,
``get_tensor(name)`` and ``get_slice(name)[...]``, which reads only the bytes of the slice.

``shard=Shard(rank, world, dim)`` reads only a rank's slice of each tensor. ``save`` writes a file safetensors reads,
with a checksum of every tensor in its metadata, which ``load(..., verify=True)`` checks.

A file that breaks the format raises ``ferry.FormatError`` naming the file, the tensor and the field; bad arguments
raise ``ferry.ArgumentError``. ``timeout`` is how long a load may go without moving a byte (``FERRY_DEADLINE``).
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from . import _ferry, _fspath  # (defined before ferry/__init__.py imports this module)

# safetensors dtype -> (torch attribute, bits per element). Names torch lacks (F4, F6) stay known to the format
# and are refused when a tensor of them is read.
_DTYPES = {
    "F64": ("float64", 64), "F32": ("float32", 32), "F16": ("float16", 16), "BF16": ("bfloat16", 16),
    "I64": ("int64", 64), "I32": ("int32", 32), "I16": ("int16", 16), "I8": ("int8", 8), "U8": ("uint8", 8),
    "U16": ("uint16", 16), "U32": ("uint32", 32), "U64": ("uint64", 64), "BOOL": ("bool", 8),
    "F8_E4M3": ("float8_e4m3fn", 8), "F8_E5M2": ("float8_e5m2", 8), "F8_E8M0": ("float8_e8m0fnu", 8),
    "C64": ("complex64", 64), "F6_E2M3": (None, 6), "F6_E3M2": (None, 6), "F4": (None, 4),
}
_CHECKSUMS = "ferry.checksum64"  # __metadata__ key: JSON object, tensor name -> hex checksum of its bytes
_MAX_HEADER = 100_000_000  # safetensors' own limit on the header's length
_STAGE_WINDOW = 256 << 20  # device memory a load holds at once for slices cut on the device
_EARLY_BYTES, _EARLY_COUNT = 64 << 20, 32  # a load's reads go out in batches of this many bytes or requests


def _errors():
    import ferry
    return ferry


def _format_error(path: str, what: str):
    e = _errors().FormatError(f"{path}: {what}")
    e.code, e.op, e.resource = "invalid_format", "safetensors", path
    return e


def _argument_error(what: str, resource: str = ""):
    e = _errors().ArgumentError(what)
    e.code, e.op, e.resource = "invalid_argument", "safetensors", resource
    return e


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world`` reads the ``rank``-th of ``world`` equal slices of each tensor along ``dim``
    (an int for every tensor, negative from the end, or a function name -> dim or None; None: the whole
    tensor). A dimension that ``world`` does not divide, a rank outside [0, world) or a dim the tensor does not
    have is a ``ferry.ArgumentError`` naming the tensor."""
    rank: int
    world: int
    dim: int | Callable[[str], int | None] = 0

    def __post_init__(self):
        for field in ("rank", "world"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool):
                raise _argument_error(f"Shard: {field} must be an int, not {type(v).__name__}")
        if self.world < 1:
            raise _argument_error(f"Shard: world={self.world}; it must be at least 1")
        if not 0 <= self.rank < self.world:
            raise _argument_error(f"Shard: rank={self.rank} is outside [0, {self.world})")
        if not callable(self.dim) and (not isinstance(self.dim, int) or isinstance(self.dim, bool)):
            raise _argument_error(f"Shard: dim must be an int or a function of the tensor's name, not {type(self.dim).__name__}")

    def dim_of(self, name: str, ndim: int) -> int | None:
        """The dimension (0 <= dim < ndim) to split tensor ``name`` along, or None to read it whole."""
        d = self.dim(name) if callable(self.dim) else self.dim
        if d is None:
            return None
        if not isinstance(d, int) or isinstance(d, bool):
            raise _argument_error(f"Shard: the rule returned {d!r} for tensor {name!r}; it must return an int or None", name)
        if not -ndim <= d < ndim:
            raise _argument_error(f"Shard: tensor {name!r} has {ndim} dimension(s); dim={d} is not one of them", name)
        return d % ndim


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the tests have torch
        raise ImportError("ferry.safetensors needs torch") from e
    return torch


# ---- the format ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple
    begin: int  # absolute offsets in the file
    end: int
    file: "_Checkpoint"

    @property
    def bits(self) -> int:
        return _DTYPES[self.dtype][1]


def _no_duplicates(path: str):
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise _format_error(path, f"the header names {k!r} twice")
            out[k] = v
        return out
    return hook


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(path: str, raw: bytes, size: int, *, strict: bool = True) -> tuple[dict, dict | None, int]:
    """Checks a safetensors header (``raw``: the bytes after the 8-byte length) against a file of ``size`` bytes.
    Returns ``({name: (dtype, shape, begin, end)}, metadata or None, data_start)`` with absolute offsets, in the
    file's order. Raises ``ferry.FormatError`` naming the file, the tensor and the field."""
    data_start = 8 + len(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _format_error(path, f"the header is not UTF-8 ({e.reason} at byte {8 + e.start})") from None
    if not text.startswith("{"):
        raise _format_error(path, "the header does not start with '{'")
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates(path))
    except json.JSONDecodeError as e:
        raise _format_error(path, f"the header is not JSON: {e.msg} at byte {8 + e.pos}") from None
    except RecursionError:
        raise _format_error(path, "the header nests too deeply") from None
    if not isinstance(header, dict):
        raise _format_error(path, "the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None:
        if not isinstance(meta, dict):
            raise _format_error(path, f"__metadata__ is a {type(meta).__name__}, not an object of strings")
        for k, v in meta.items():
            if not isinstance(v, str) and strict:
                raise _format_error(path, f"__metadata__[{k!r}] is a {type(v).__name__}, not a string")
    tensors = {}
    for name, info in header.items():
        what = f"tensor {name!r}"
        if not isinstance(info, dict):
            raise _format_error(path, f"{what}: its entry is a {type(info).__name__}, not an object")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in info:
                raise _format_error(path, f"{what}: no {field}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise _format_error(path, f"{what}: dtype {dtype!r} is not a safetensors dtype")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _format_error(path, f"{what}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise _format_error(path, f"{what}: data_offsets {offsets!r} is not a pair of integers")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise _format_error(path, f"{what}: data_offsets [{begin}, {end}] are not 0 <= begin <= end")
        bits = math.prod(shape) * _DTYPES[dtype][1]
        if bits % 8 or bits // 8 != end - begin:
            raise _format_error(path, f"{what}: data_offsets [{begin}, {end}] span {end - begin} bytes, but shape "
                                      f"{shape} of {dtype} is {bits / 8:g} bytes")
        if data_start + end > size:
            raise _format_error(path, f"{what}: data_offsets [{begin}, {end}] end past the file's {size - data_start} "
                                      "bytes of data (the file is cut short)")
        tensors[name] = (dtype, tuple(shape), data_start + begin, data_start + end)
    if strict:
        # The tensors tile the data section exactly: in order, no overlap, no gap, nothing after the last.
        at = data_start
        for name, (_, _, begin, end) in sorted(tensors.items(), key=lambda kv: (kv[1][2], kv[1][3])):
            if begin != at:
                why = "overlaps the tensor before it" if begin < at else f"leaves a gap of {begin - at} bytes before it"
                raise _format_error(path, f"tensor {name!r}: data_offsets [{begin - data_start}, {end - data_start}] {why}")
            at = end
        if at != size:
            raise _format_error(path, f"{size - at} bytes after the last tensor's data (the data section is "
                                      f"{at - data_start} bytes, the file holds {size - data_start})")
    return tensors, meta, data_start


class _Checkpoint:
    """One safetensors file: its header, checked, and how to reach its bytes."""

    def __init__(self, path: str, *, strict: bool):
        self.path = path
        self.remote = "://" in path
        self._file = None  # ferry.File, opened when bytes are read through the file engine
        self._storage = None  # the file mapped (CPU tensors over its pages)
        if self.remote:
            import ferry
            self._file = ferry.open(path)
            self.size = self._file.size
            read = self._read_remote
        else:
            self.size, self._fd = _open_regular(path)
            read = self._read_local
        try:
            head = read(0, 8) if self.size >= 8 else b""
            if len(head) != 8:
                raise _format_error(path, f"{self.size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise _format_error(path, f"header length {n} is over safetensors' limit of {_MAX_HEADER} bytes")
            if 8 + n > self.size:
                raise _format_error(path, f"header length {n} does not fit the file's {self.size} bytes")
            raw = read(8, n)
            if len(raw) != n:
                raise _format_error(path, f"read {len(raw)} of the header's {n} bytes (the file shrank?)")
            found, self.metadata, self.data_start = parse_header(path, raw, self.size, strict=strict)
        finally:
            if not self.remote:
                os.close(self._fd)
                self._fd = -1
        self.entries = {name: _Entry(name, d, s, b, e, self) for name, (d, s, b, e) in found.items()}

    def _read_local(self, offset: int, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            piece = os.pread(self._fd, n - len(out), offset + len(out))
            if not piece:
                break
            out += piece
        return bytes(out)

    def _read_remote(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        got = self._file.read_into(buf, offset) if n else 0
        return bytes(buf[:got])

    def file(self):
        """The ferry.File of this checkpoint (opened on first use)."""
        if self._file is None:
            import ferry
            self._file = ferry.open(self.path)
            if self._file.size != self.size:
                raise _format_error(self.path, f"the file changed size from {self.size} to {self._file.size} bytes while it was opened")
        return self._file

    def mapped(self, torch):
        """The whole file as CPU storage over a private mapping of its pages (copy-on-write)."""
        if self._storage is None:
            self._storage = torch.UntypedStorage.from_file(self.path, False, self.size)
        return self._storage

    def close(self):
        if self._file is not None:
            self._file.close()
        self._file = None
        self._storage = None


def _open_regular(path: str) -> tuple[int, int]:
    """Opens a local file for reading without blocking on a FIFO or device; refuses anything but a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        import ferry
        err = ferry.Error(f"{path}: cannot open for reading: {e.strerror} (errno {e.errno})")
        err.code = "not_found" if e.errno == 2 else "permission_denied" if e.errno == 13 else "io_error"
        err.op, err.resource, err.errno = "safetensors", path, e.errno
        raise err from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, socket or device)"
        raise _argument_error(f"{path}: {kind}; a checkpoint is a .safetensors file, a folder of them or an index", path)
    os.set_blocking(fd, True)
    return st.st_size, fd


# ---- checkpoints of several files --------------------------------------------------------------------------


def _join(base: str, name: str) -> str:
    if "://" in base:
        return base.rsplit("/", 1)[0] + "/" + name
    return os.path.join(os.path.dirname(base), name)


def _index_files(index: str, *, strict: bool) -> tuple[list[str], dict]:
    """The shard files of a ``*.safetensors.index.json`` (in its order) and its weight map."""
    if "://" in index:
        import ferry
        with ferry.open(index) as f:
            buf = bytearray(f.size)
            f.read_into(buf)
            raw = bytes(buf)
    else:
        size, fd = _open_regular(index)
        try:
            raw = os.pread(fd, size, 0)
        finally:
            os.close(fd)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(index))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _format_error(index, f"the index is not JSON: {e}") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise _format_error(index, "no weight_map object of tensor name -> shard file")
    files = []
    for name, shard in wm.items():
        if shard.startswith("/") or ".." in shard.split("/") or not shard:
            raise _format_error(index, f"weight_map[{name!r}] = {shard!r} is not a file beside the index")
        if shard not in files:
            files.append(shard)
    return [_join(index, s) for s in files], wm


def _resolve(path: Any) -> tuple[list[str], str | None, dict | None]:
    """The files of a checkpoint: ``(files, index path or None, weight map or None)``."""
    p = _fspath(path)
    if p.endswith(".index.json"):
        files, wm = _index_files(p, strict=True)
        return files, p, wm
    if "://" not in p and os.path.isdir(p):
        names = sorted(os.listdir(p))
        indexes = [n for n in names if n.endswith(".safetensors.index.json")]
        if "model.safetensors.index.json" in indexes:
            indexes = ["model.safetensors.index.json"]
        if len(indexes) > 1:
            raise _argument_error(f"{p}: several indexes ({', '.join(indexes)}); name the one to load", p)
        if indexes:
            idx = os.path.join(p, indexes[0])
            files, wm = _index_files(idx, strict=True)
            return files, idx, wm
        files = [os.path.join(p, n) for n in names if n.endswith(".safetensors")]
        if not files:
            raise _argument_error(f"{p}: a folder with no .safetensors file and no *.safetensors.index.json", p)
        return files, None, None
    return [p], None, None


class _Set:
    """The checkpoint's files and every tensor in them, by name."""

    def __init__(self, path: Any, strict: bool):
        files, self.index, wm = _resolve(path)
        self.files = []
        self.entries: dict[str, _Entry] = {}
        try:
            for f in files:
                ck = _Checkpoint(f, strict=strict)
                self.files.append(ck)
                for name, e in ck.entries.items():
                    if name in self.entries:
                        raise _format_error(f, f"tensor {name!r} is in {self.entries[name].file.path} too")
                    self.entries[name] = e
            if wm is not None:
                for name, shard in wm.items():
                    e = self.entries.get(name)
                    if e is None:
                        raise _format_error(self.index, f"weight_map names tensor {name!r}, which no shard holds")
                    if e.file.path != _join(self.index, shard):
                        raise _format_error(self.index, f"weight_map puts tensor {name!r} in {shard}, but it is in {e.file.path}")
        except BaseException:
            self.close()
            raise

    def metadata(self) -> dict | None:
        meta = None
        for f in self.files:
            if f.metadata is not None:
                meta = {**(meta or {}), **f.metadata}
        return meta

    def pick(self, names) -> list[_Entry]:
        if names is None:
            return list(self.entries.values())
        if isinstance(names, (str, bytes)):
            raise _argument_error(f"names={names!r} is one string; pass an iterable of tensor names, e.g. [{names!r}]")
        wanted = list(names)
        missing = [n for n in wanted if n not in self.entries]
        if missing:
            where = self.index or self.files[0].path
            raise _argument_error(f"{where}: no tensor named {', '.join(map(repr, missing[:5]))}" + (" ..." if len(missing) > 5 else ""), where)
        return [self.entries[n] for n in wanted]

    def close(self):
        for f in self.files:
            f.close()


# ---- slices --------------------------------------------------------------------------------------------------


def _normalize(key, shape: tuple, name: str):
    """A __getitem__ key over ``shape`` as per-dimension (start, stop, step) and the dims that ints remove."""
    if not isinstance(key, tuple):
        key = (key,)
    if any(k is Ellipsis for k in key):
        i = next(i for i, k in enumerate(key) if k is Ellipsis)
        rest = [k for k in key[i + 1:]]
        if any(k is Ellipsis for k in rest):
            raise _argument_error(f"tensor {name!r}: a slice may hold one '...'", name)
        key = key[:i] + (slice(None),) * (len(shape) - len(key) + 1) + tuple(rest)
    if len(key) > len(shape):
        raise _argument_error(f"tensor {name!r} has {len(shape)} dimension(s); the slice indexes {len(key)}", name)
    key = key + (slice(None),) * (len(shape) - len(key))
    ranges, drop = [], []
    for d, (k, n) in enumerate(zip(key, shape)):
        if isinstance(k, slice):
            start, stop, step = k.indices(n)
            if step < 1:
                raise _argument_error(f"tensor {name!r}: dim {d}: step {step} (only positive steps)", name)
            ranges.append((start, max(start, stop), step))
        elif _is_int(k) or hasattr(k, "__index__"):
            i = int(k.__index__())
            if not -n <= i < n:
                raise _argument_error(f"tensor {name!r}: index {i} is out of range for dim {d} of size {n}", name)
            i %= n
            ranges.append((i, i + 1, 1))
            drop.append(d)
        else:
            raise _argument_error(f"tensor {name!r}: cannot index with {type(k).__name__} (ints, slices and ... only)", name)
    return ranges, drop


def _ranges_count(r) -> int:
    start, stop, step = r
    return max(0, (stop - start + step - 1) // step)


class _Plan:
    """Reads into final tensors: requests straight into the destination, and windows read as one span into a
    temporary on the device and cut there. Every request of a wave goes out as one batch; with ``early``,
    direct reads go out in batches as they are planned."""

    def __init__(self, torch, device, *, timeout: float | None = None, early: bool = False, after_torch: bool = True):
        self.torch, self.device = torch, device
        self.after_torch = after_torch  # False: the buffers are the caller's own, no torch work on them queued
        self.direct = []  # (file, offset, uint8 view of the destination)
        self.windows = []  # (file, offset, nbytes, cut(temp uint8 tensor))
        self.bytes_read = 0  # what run() read from the files
        # early: direct reads go out as they are planned, a batch per _EARLY_BYTES or _EARLY_COUNT of
        # them, so that the files' first bytes move while the rest of the plan (a few tens of
        # microseconds of Python per tensor) is made; run() then waits for them all.
        self.timeout, self.early = timeout, early
        self.started = []  # (batch, its requests)
        self._held = 0  # bytes of self.direct

    def read_to(self, e: _Entry, out, ranges) -> None:
        """Reads the elements ``ranges`` (per dim (start, stop, step)) of entry ``e`` into ``out`` (contiguous,
        their shape): contiguous runs straight into ``out`` when they are few or large, else spans of rows into
        bounded temporaries, cut on the device."""
        torch = self.torch
        shape = e.shape
        esize = e.bits // 8
        counts = [_ranges_count(r) for r in ranges]
        if math.prod(counts) == 0:
            return
        strides = [esize] * len(shape)  # bytes
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        # k: the last dim the selection does not take whole; after it each run is contiguous.
        k = -1
        for d in range(len(shape)):
            if ranges[d] != (0, shape[d], 1):
                k = d
        flat = out.reshape(-1).view(torch.uint8)
        if k < 0:
            self._direct(e.file, e.begin, flat)
            return
        start_k, _, step_k = ranges[k]
        run = (counts[k] * strides[k]) if step_k == 1 else strides[k]
        outer = counts[:k] if step_k == 1 else counts[:k + 1]
        nruns = math.prod(outer)
        if nruns <= 64 or (nruns <= 4096 and run >= 64 << 10) or run >= 1 << 20:
            idx_dims = list(range(k)) if step_k == 1 else list(range(k + 1))
            pos = 0
            for flat_i in range(nruns):
                off, rem = e.begin, flat_i
                for d in reversed(idx_dims):
                    i = rem % counts[d]
                    rem //= counts[d]
                    off += (ranges[d][0] + i * ranges[d][2]) * strides[d]
                if step_k == 1:
                    off += start_k * strides[k]
                self._direct(e.file, off, flat[pos:pos + run])
                pos += run
            return
        # Spans: along dim 0 of the selection, as many indices at a time as fit the window.
        d0_start, _, d0_step = ranges[0]
        row_span = _span_bytes(ranges[1:], strides[1:], esize) if len(shape) > 1 else esize
        per = max(1, _STAGE_WINDOW // max(1, d0_step * strides[0]))
        out_rows = out.reshape((counts[0], -1)) if len(shape) > 1 else out.reshape(-1, 1)
        for i0 in range(0, counts[0], per):
            n0 = min(per, counts[0] - i0)
            first = e.begin + (d0_start + i0 * d0_step) * strides[0] + _first_offset(ranges[1:], strides[1:])
            span = (n0 - 1) * d0_step * strides[0] + row_span
            sizes = [n0] + counts[1:]
            view_strides = [strides[d] // esize * ranges[d][2] for d in range(len(shape))]
            dest = out_rows[i0:i0 + n0].view(sizes)
            dtype = out.dtype

            def cut(temp, sizes=sizes, view_strides=view_strides, dest=dest, dtype=dtype):
                dest.copy_(temp.view(dtype).as_strided(sizes, view_strides, 0))

            self.windows.append((e.file, first, span, cut))

    def _direct(self, f, offset: int, buf) -> None:
        self.direct.append((f, offset, buf))
        self._held += buf.numel()
        if self.early and (len(self.direct) >= _EARLY_COUNT or self._held >= _EARLY_BYTES):
            self._start()

    def flush(self) -> None:
        """Sends the direct reads not yet sent (an early plan's last batch) without waiting for them."""
        if self.direct:
            self._start()

    def _start(self) -> None:
        import ferry

        requests = [(f.file(), off, buf) for f, off, buf in self.direct]
        self.direct, self._held = [], 0
        self.started.append((ferry._batch(requests, False, None, self.timeout, self.after_torch), requests))
        self.bytes_read += sum(buf.numel() for _, _, buf in requests)

    def run(self, *, timeout: float | None, progress: "_Progress | None", what: str) -> None:
        torch = self.torch
        if self.started:
            self.flush()
            _wait_all(self.started, progress=progress)
            self.started = []
        waves, wave, held = [], [], 0
        for w in self.windows:
            if wave and held + w[2] > _STAGE_WINDOW:
                waves.append(wave)
                wave, held = [], 0
            wave.append(w)
            held += w[2]
        waves.append(wave)
        direct = self.direct
        for wave in waves:
            temps = [torch.empty(n, dtype=torch.uint8, device=self.device) for (_, _, n, _) in wave]
            requests = [(f.file(), off, buf) for f, off, buf in direct]
            requests += [(f.file(), off, t) for (f, off, _, _), t in zip(wave, temps)]
            direct = []
            if requests:
                _read_all(requests, timeout=timeout, progress=progress, what=what)
                self.bytes_read += sum(buf.numel() for _, _, buf in requests)
            for (_, _, _, cut), t in zip(wave, temps):
                cut(t)


def _first_offset(ranges, strides) -> int:
    return sum(r[0] * s for r, s in zip(ranges, strides))


def _span_bytes(ranges, strides, esize) -> int:
    """Bytes from the first selected element of ``ranges`` to the end of the last."""
    last = sum((r[0] + (_ranges_count(r) - 1) * r[2] - r[0]) * s for r, s in zip(ranges, strides))
    return last + esize


def _read_all(requests, *, timeout, progress, what) -> None:
    """One batch of (ferry.File, offset, buffer) reads; fails when no byte moves for ``timeout`` seconds."""
    import ferry

    _wait_all([(ferry.read_batch(requests, timeout=timeout), requests)], progress=progress)


def _wait_all(started, *, progress) -> None:
    """Waits for batches of reads already started, [(batch, its (file, offset, buffer) requests)]; raises the
    first failure, or FormatError for a read cut short. Every batch is closed (waited for) on the way out."""
    try:
        if progress is not None:
            progress.add_total(sum(b.bytes_total for b, _ in started))
        # Each batch is checked as soon as it is done, while the later ones still run: checked after the
        # last, the checks of every request would be time the load spends with nothing moving.
        for batch, requests in started:
            while not batch.done():
                batch.wait(0.1)  # False at the batch's deadline too, which check() then reports
                if progress is not None:
                    progress.update(sum(b.bytes_done for b, _ in started))
            batch.check()
            for (f, off, buf), res in zip(requests, batch.results()):
                want = buf.numel() * buf.element_size()
                if res["bytes_done"] != want:  # the file was cut short after its header was read
                    raise _format_error(f.path, f"read {res['bytes_done']} of {want} bytes at offset {off}: the file is cut short")
        if progress is not None:
            progress.update(sum(b.bytes_done for b, _ in started), final=True)
    finally:
        for batch, _ in started:
            batch.close()


class _Progress:
    """A progress line on a terminal: tqdm if installed, else a plain one; nothing when not a terminal."""

    def __init__(self, label: str, enabled: bool):
        self.bar = None
        self.plain = False
        self.label, self.last, self.total, self.base, self.done = label, 0.0, 0, 0, 0
        if not enabled or not sys.stderr.isatty():
            self.enabled = False
            return
        self.enabled = True
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=0, unit="B", unit_scale=True, desc=label)
        except ImportError:
            self.plain = True

    def add_total(self, n: int) -> None:
        self.base = self.done
        self.total += n
        if self.bar is not None:
            self.bar.total = self.total

    def update(self, batch_done: int, final: bool = False) -> None:
        self.done = self.base + batch_done
        if self.bar is not None:
            self.bar.update(self.done - self.bar.n)
        elif self.plain and (final or time.monotonic() - self.last > 0.2):
            self.last = time.monotonic()
            sys.stderr.write(f"\r{self.label}: {self.done / 2**20:.0f} / {self.total / 2**20:.0f} MiB")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.plain:
            sys.stderr.write("\n")


# ---- tensors -------------------------------------------------------------------------------------------------


def _dtype(torch, e: _Entry):
    attr = _DTYPES[e.dtype][0]
    dt = getattr(torch, attr, None) if attr else None
    if dt is None:
        raise _argument_error(f"{e.file.path}: tensor {e.name!r} is {e.dtype}, which this torch ({torch.__version__}) has no dtype for",
                              e.file.path)
    return dt


def _is_cpu(dev) -> bool:
    return dev.type == "cpu"


def _mapped_tensor(torch, e: _Entry, dt):
    """Tensor ``e`` over the file's mapped pages (no copy), or a copy where its offset is not aligned to its dtype."""
    storage = e.file.mapped(torch)
    esize = max(1, e.bits // 8)
    if e.begin % esize == 0:  # one op per tensor: a view of the storage at its offset, in its dtype and shape
        return torch.empty(0, dtype=dt).set_(storage, e.begin // esize, e.shape)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, e.begin, (e.end - e.begin,))
    return raw.clone().view(dt).reshape(e.shape)


def _timeout(timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, str):
        return _ferry.parse_duration(timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise _argument_error(f"timeout={timeout!r}: seconds (a number >= 0) or a duration such as '5min'")
    return float(timeout)


def _slice_of(e: _Entry, shard: Shard | None) -> tuple[int | None, list | None]:
    """The dimension a shard splits tensor ``e`` along and the rank's ranges of it, or (None, None): whole."""
    dim = shard.dim_of(e.name, len(e.shape)) if shard is not None and e.shape else None
    if dim is None:
        return None, None
    n = e.shape[dim]
    if n % shard.world:
        raise _argument_error(f"{e.file.path}: tensor {e.name!r} dim {dim} of size {n} does not split into "
                              f"{shard.world} equal parts", e.file.path)
    part = n // shard.world
    ranges = [(0, s, 1) for s in e.shape]
    ranges[dim] = (shard.rank * part, (shard.rank + 1) * part, 1)
    return dim, ranges


def _load(ck: _Set, entries: list[_Entry], device, *, shard: Shard | None, mmap: bool, timeout, progress: bool,
          label: str, stats: dict | None = None) -> dict:
    torch = _torch()
    dev = torch.device(device)
    out = {}
    plan = _Plan(torch, dev, timeout=_timeout(timeout), early=True)
    for e in entries:
        dt = _dtype(torch, e)
        dim, ranges = _slice_of(e, shard)
        if _is_cpu(dev) and mmap and not e.file.remote:
            t = _mapped_tensor(torch, e, dt)
            if ranges is not None:
                t = t.narrow(dim, ranges[dim][0], ranges[dim][1] - ranges[dim][0]).contiguous()
            out[e.name] = t
            continue
        shape = e.shape if ranges is None else tuple(_ranges_count(r) for r in ranges)
        t = torch.empty(shape, dtype=dt, device=dev)
        out[e.name] = t
        if t.numel():
            plan.read_to(e, t, ranges or [(0, s, 1) for s in e.shape])
    bar = _Progress(label, progress)
    try:
        plan.run(timeout=_timeout(timeout), progress=bar if bar.enabled else None, what=label)
    finally:
        bar.close()
    if stats is not None:
        stats["bytes_read"] = stats.get("bytes_read", 0) + plan.bytes_read
    return out


_COOP_WINDOW = 512 << 20  # a wave's tensor bytes per rank; a rank holds at most two waves' whole tensors


def _owners(sizes: list[int], world: int) -> list[int]:
    """Which rank reads each tensor: the largest first, each to the rank with the fewest bytes so far (ties: the
    lower rank). The same on every rank: it depends on the sizes and the world only."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _waves(sizes: list[int], world: int, window: int) -> list[list[int]]:
    """Consecutive tensors in groups of at most ``world * window`` bytes (a tensor larger than that alone)."""
    waves, wave, held = [], [], 0
    for i, n in enumerate(sizes):
        if wave and held + n > world * window:
            waves.append(wave)
            wave, held = [], 0
        wave.append(i)
        held += n
    if wave:
        waves.append(wave)
    return waves


def _shard_specs(torch, entries: list[_Entry], shard: Shard) -> list[tuple]:
    """(entry, dtype, split dim or None, one rank's shape) per tensor: every rule checked before anything is read."""
    specs = []
    for e in entries:
        dim, ranges = _slice_of(e, shard)
        specs.append((e, _dtype(torch, e), dim, e.shape if ranges is None else tuple(_ranges_count(r) for r in ranges)))
    return specs


def _own_slice(e: _Entry, dim: int | None, world: int) -> bool:
    """Whether every rank reads its own slice of ``e`` itself: its slices along ``dim`` are contiguous in the file
    (dim 0, or only dims of size 1 before it), so reading them is reading the tensor once between the ranks."""
    return dim is not None and math.prod(e.shape[:dim]) == 1


def _deadline_s(timeout) -> float:
    t = _timeout(timeout)
    if t is None:
        import ferry

        t = _ferry.parse_duration(ferry.settings()["FERRY_DEADLINE"])
    return t


def _wait_events(events, timeout: float, label: str) -> None:
    """Waits for CUDA events (the devices' exchange of a wave), polling: a ferry.Error (code "timeout") when they
    are not all done ``timeout`` seconds after the last one that was."""
    deadline, nap = time.monotonic() + timeout, 1e-5
    for ev in events:
        while not ev.query():
            if time.monotonic() > deadline:
                e = _errors().Error(f"{label}: the devices' exchange of a wave made no progress for {timeout:g} s")
                e.code, e.op, e.resource = "timeout", "safetensors", label
                raise e
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)
        deadline, nap = time.monotonic() + timeout, 1e-5


def _close_started(plan) -> None:
    """Cancels and waits for the batches a plan sent (their buffers may go afterwards), every one of them."""
    for batch, _ in plan.started:
        try:
            batch.cancel()
            batch.close()
        except Exception:  # noqa: BLE001 - the load is failing already; this only ends the reads
            pass
    plan.started = []


def _whole_reads(torch, specs: list[tuple], world: int, *, mine, device_of, result_of, timeout, bar, label: str):
    """The read plan of both tensor-parallel loads, a generator of waves (consecutive tensors, at most world x
    _COOP_WINDOW bytes). A tensor whose slices are contiguous in the file (_own_slice) is read by every rank
    ``mine(rank)`` says this process reads, its own slice straight into ``result_of(rank, i)``; any other tensor
    has one reader (_owners over the wave's other tensors), which reads it whole, straight into its result when
    every rank keeps it whole, else into a slot of its device. Yields, per wave, (the indices to exchange, owner
    by index, {index: whole tensor} of those this process read, bytes read) once the wave's reads are done.

    The consumer queues the exchange on the devices' current streams and need not wait for it: the next wave's
    reads run meanwhile. Whole tensors go into two slots per device, allocated once (each the most one wave puts
    on that device) and used by waves in turn; a slot is read into again only after the exchange of the wave
    that used it is done (events on the current streams). The slots and the results are made on the current
    streams, which are waited for once, at the start; after that nothing torch queues uses the memory ferry
    reads into except the exchange, which the events order, so the reads do not wait for the current streams
    (they would wait for the exchange under way). Returns when every wave's exchange is done."""
    sizes = [e.end - e.begin for e, *_ in specs]
    plans = []  # per wave: (tensors, the shared ones, owner by index, {index: (device, offset in its slot)})
    need = {}  # device -> the most one wave puts in its slot
    for wave in _waves(sizes, world, _COOP_WINDOW):
        shared = [i for i in wave if sizes[i] and not _own_slice(specs[i][0], specs[i][2], world)]
        owner = dict(zip(shared, _owners([sizes[i] for i in shared], world)))
        at, used = {}, {}
        for i in shared:
            if specs[i][2] is None or not mine(owner[i]):
                continue  # kept whole by every rank: read straight into the result
            d = device_of(owner[i])
            at[i] = (d, used.get(d, 0))
            used[d] = used.get(d, 0) + (sizes[i] + 4095) // 4096 * 4096
        for d, n in used.items():
            need[d] = max(need.get(d, 0), n)
        plans.append((wave, shared, owner, at))
    slots = {d: [torch.empty(n, dtype=torch.uint8, device=d) for _ in range(2)] for d, n in need.items()}
    gpus = {device_of(r) for r in range(world) if mine(r)}
    gpus = [d for d in gpus if d.type == "cuda"]
    for d in gpus:
        torch.cuda.current_stream(d).synchronize()
    limit = _deadline_s(timeout)

    def start(k):
        wave, shared, owner, at = plans[k]
        plan = _Plan(torch, device_of(0), timeout=_timeout(timeout), early=True, after_torch=False)
        whole = {}
        try:
            for i in wave:
                e, dt, dim, _ = specs[i]
                if not sizes[i]:
                    continue
                if i not in owner:
                    part = e.shape[dim] // world
                    for r in range(world):
                        if mine(r):
                            ranges = [(0, n, 1) for n in e.shape]
                            ranges[dim] = (r * part, (r + 1) * part, 1)
                            plan.read_to(e, result_of(r, i), ranges)
                    continue
                if not mine(owner[i]):
                    continue
                if i in at:
                    d, off = at[i]
                    whole[i] = slots[d][k % 2][off:off + sizes[i]].view(dt).view(e.shape)
                else:
                    whole[i] = result_of(owner[i], i)
                plan.read_to(e, whole[i], [(0, n, 1) for n in e.shape])
            plan.flush()
        except BaseException:
            _close_started(plan)
            raise
        return shared, owner, whole, plan

    behind = []  # events after the exchange of the wave yielded last
    nxt = None
    try:
        nxt = start(0) if plans else None
        for k in range(len(plans)):
            shared, owner, whole, plan = nxt
            nxt = None
            plan.run(timeout=_timeout(timeout), progress=bar if bar.enabled else None, what=label)
            if k + 1 < len(plans):
                _wait_events(behind, limit, label)  # wave k-1's exchange: its slot is wave k+1's
                behind = []
                nxt = start(k + 1)
            yield shared, owner, whole, plan.bytes_read
            for d in gpus:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(d))
                behind.append(ev)
        _wait_events(behind, limit, label)
    finally:
        if nxt is not None:  # the consumer failed: the reads already sent end before the slots can go
            _close_started(nxt[3])


def _cooperative(ck: _Set, entries: list[_Entry], device, *, shard: Shard | None, group, timeout, progress: bool,
                 label: str, stats: dict | None) -> dict:
    """The ranks of ``group`` read every tensor once between them and hand each other what they need: a tensor
    split into contiguous slices (along dim 0) each rank reads its own slice of; any other tensor one rank reads
    whole and broadcasts, each rank keeping its slice along the split dimension (or all of it). Collectives go in
    the same order on every rank: the plan depends only on the checkpoint and the rule."""
    import torch.distributed as dist

    torch = _torch()
    dev = torch.device(device)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if shard is None:
        shard = Shard(me, world, lambda name: None)
    if shard.world != world or shard.rank != me:
        raise _argument_error(f"Shard(rank={shard.rank}, world={shard.world}) does not match the group: this process "
                              f"is rank {me} of {world}")

    def global_rank(r: int) -> int:
        if group is None or group is dist.group.WORLD:
            return r
        get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
        return get(group, r)

    specs = _shard_specs(torch, entries, shard)
    out = {e.name: torch.empty(local, dtype=dt, device=dev) for e, dt, _, local in specs}
    # Another reader's split tensor arrives here, one at a time: the next broadcast into it is queued after
    # the copy out of it (the collective's stream waits for the current one), so one buffer serves them all.
    biggest = max((e.end - e.begin for e, _, dim, _ in specs if dim is not None and not _own_slice(e, dim, world)),
                  default=0)
    recv = torch.empty(biggest, dtype=torch.uint8, device=dev) if biggest else None
    bar = _Progress(label, progress)
    read = 0
    try:
        for shared, owner, whole, n in _whole_reads(torch, specs, world, mine=lambda r: r == me,
                                                    device_of=lambda r: dev, result_of=lambda r, i: out[specs[i][0].name],
                                                    timeout=timeout, bar=bar, label=label):
            read += n
            for i in shared:
                e, dt, dim, local = specs[i]
                src = global_rank(owner[i])
                mine = out[e.name].reshape(-1).view(torch.uint8)
                if dim is None:
                    dist.broadcast(mine, src=src, group=group)
                else:
                    # The whole tensor to every rank, each keeping its slice: a broadcast runs on the rings the
                    # group already has, where a scatter (sends and receives) makes NCCL connect every pair of
                    # ranks first -- a second and more on a process's first load, far more than the bytes cost.
                    full = whole[i] if owner[i] == me else recv[:e.end - e.begin].view(dt).view(e.shape)
                    dist.broadcast(full.reshape(-1).view(torch.uint8), src=src, group=group)
                    out[e.name].copy_(full.chunk(world, dim)[me])
    finally:
        bar.close()
    if stats is not None:
        stats["bytes_read"] = stats.get("bytes_read", 0) + read
    return out


def load(path: Any, device: Any = "cpu", names: Iterable[str] | None = None, *, shard: Shard | None = None,
         group: Any = None, progress: bool = True, verify: bool = False, timeout: float | str | None = None,
         strict: bool = True, mmap: bool = True, stats: dict | None = None) -> dict:
    """Loads a checkpoint (a .safetensors file, a folder of shards or its index; local, os.PathLike or ferry://)
    into tensors on ``device``: ``{name: tensor}``. ``names``: only these tensors. ``shard``: this rank's slices.
    ``group`` (a torch.distributed process group of the ranks of one node, every rank calling with its own
    ``shard``): the ranks read each tensor once between them and hand each other the slices. ``timeout``: seconds
    (or a duration such as "5min") the load may go without moving a byte. ``strict=False`` accepts files whose
    tensors do not tile the data section exactly. On the CPU, ``mmap=False`` copies instead of mapping the file.
    ``stats``: a dict that gets ``bytes_read``, what this process read through the file engine (a CPU load that
    maps the file reads nothing up front)."""
    if shard is not None and not isinstance(shard, Shard):
        raise _argument_error(f"shard must be a ferry.safetensors.Shard, not {type(shard).__name__}")
    ck = _Set(path, strict)
    try:
        entries = ck.pick(names)
        label = f"ferry load {_fspath(path)}"
        if group is not None:
            out = _cooperative(ck, entries, device, shard=shard, group=group, timeout=timeout, progress=progress,
                               label=label, stats=stats)
        else:
            out = _load(ck, entries, device, shard=shard, mmap=mmap, timeout=timeout, progress=progress, label=label,
                        stats=stats)
        if verify:
            _verify(ck, entries, out, shard)
        return out
    finally:
        ck.close()


def load_shards(path: Any, devices: Iterable[Any], dim: int | Callable[[str], int | None] = 0,
                names: Iterable[str] | None = None, *, progress: bool = True, timeout: float | str | None = None,
                strict: bool = True, stats: dict | None = None) -> list[dict]:
    """One process, several devices: the tensor-parallel slices of a checkpoint for each of ``devices`` (device r
    gets what ``Shard(r, len(devices), dim)`` gives rank r), one ``{name: tensor}`` per device. Every byte is read
    once: a tensor split along dim 0 as each device's slice straight into it; any other tensor whole into one
    device (the largest first, to the device with the fewest bytes so far), then its slices, or the whole tensor
    where ``dim`` gives None, are copied device to device while the next wave is read. A wave's reads go out
    together, so every device's link is busy at once. Each device holds two slots for whole tensors, each the
    most one wave puts there (about 512 MiB). ``stats`` gets ``bytes_read``."""
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable):
        raise _argument_error(f"devices must be a list of devices, not {type(devices).__name__}")
    torch = _torch()
    devs = [torch.device(d) for d in devices]
    if not devs:
        raise _argument_error("devices is empty")
    world = len(devs)
    rule = Shard(0, world, dim)
    ck = _Set(path, strict)
    try:
        entries = ck.pick(names)
        label = f"ferry load {_fspath(path)}"
        specs = _shard_specs(torch, entries, rule)
        outs = [{e.name: torch.empty(local, dtype=dt, device=dev) for e, dt, _, local in specs} for dev in devs]
        bar = _Progress(label, progress)
        read = 0
        try:
            for _, _, whole, n in _whole_reads(torch, specs, world, mine=lambda r: True, device_of=lambda r: devs[r],
                                               result_of=lambda r, i: outs[r][specs[i][0].name], timeout=timeout,
                                               bar=bar, label=label):
                read += n
                for i, t in whole.items():
                    e, _, d, _ = specs[i]
                    parts = [t] * world if d is None else t.chunk(world, d)
                    for r in range(world):
                        if outs[r][e.name] is not t:
                            outs[r][e.name].copy_(parts[r], non_blocking=True)
        finally:
            bar.close()
        if stats is not None:
            stats["bytes_read"] = stats.get("bytes_read", 0) + read
        return outs
    finally:
        ck.close()


def _verify(ck: _Set, entries, out, shard) -> None:
    sums = {}
    for f in ck.files:
        sums.update(json.loads((f.metadata or {}).get(_CHECKSUMS, "{}")))
    if not sums:
        raise _format_error(ck.index or ck.files[0].path, f"verify=True but the checkpoint has no {_CHECKSUMS} metadata "
                                                         "(files saved by ferry.safetensors.save have it)")
    for e in entries:
        if shard is not None and e.shape and shard.dim_of(e.name, len(e.shape)) is not None:
            continue  # a slice: the file's checksum is of the whole tensor
        if e.name not in sums:
            raise _format_error(e.file.path, f"verify=True but tensor {e.name!r} has no checksum in {_CHECKSUMS}")
        got = checksum(out[e.name])
        if f"{got:016x}" != sums[e.name]:
            raise _format_error(e.file.path, f"tensor {e.name!r}: checksum {got:016x} != {sums[e.name]} in the file")


class _Slice:
    """``safe_open(...).get_slice(name)``: the tensor's shape and dtype now, its bytes when indexed."""

    def __init__(self, handle: "safe_open", e: _Entry):
        self._h, self._e = handle, e

    def get_shape(self) -> list:
        return list(self._e.shape)

    def get_dtype(self) -> str:
        return self._e.dtype

    def __getitem__(self, key):
        h, e = self._h, self._e
        torch = _torch()
        dt = _dtype(torch, e)
        ranges, drop = _normalize(key, e.shape, e.name)
        shape = tuple(_ranges_count(r) for r in ranges)
        if _is_cpu(h._device) and h._mmap and not e.file.remote:
            t = _mapped_tensor(torch, e, dt)
            t = t[tuple(slice(a, b, s) for a, b, s in ranges)].clone()
        else:
            t = torch.empty(shape, dtype=dt, device=h._device)
            if t.numel():
                plan = _Plan(torch, h._device)
                plan.read_to(e, t, ranges)
                plan.run(timeout=h._timeout, progress=None, what=e.name)
        if drop:
            t = t.reshape([n for d, n in enumerate(shape) if d not in drop])
        return t


class safe_open:
    """safetensors' ``safe_open`` over ferry: ``with safe_open(path, framework="pt", device="cuda:0") as f``, then
    ``f.keys()``, ``f.metadata()``, ``f.get_tensor(name)``, ``f.get_slice(name)[...]``. ``path`` may also be a
    folder of shards or an index. ``prefetch()`` (or ``get_tensors()``) reads every tensor as one batch, for a
    caller that will read them all. On the CPU tensors map the file's pages unless ``mmap=False``."""

    def __init__(self, filename: Any, framework: str = "pt", device: Any = "cpu", *, strict: bool = True,
                 timeout: float | str | None = None, mmap: bool = True):
        if framework not in ("pt", "torch", "pytorch"):
            raise _argument_error(f"framework={framework!r}: ferry's safe_open makes torch tensors (framework='pt')")
        torch = _torch()
        self._device = torch.device(f"cuda:{device}" if _is_int(device) else device)
        self._timeout = _timeout(timeout)
        self._mmap = mmap
        self._set = _Set(filename, strict)
        self._cache: dict = {}

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._set is not None:
            self._set.close()
        self._cache = {}

    def keys(self) -> list:
        return sorted(self._set.entries)

    def offset_keys(self) -> list:
        return [e.name for e in sorted(self._set.entries.values(), key=lambda e: (e.file.path, e.begin))]

    def metadata(self) -> dict | None:
        return self._set.metadata()

    def _entry(self, name: str) -> _Entry:
        if not isinstance(name, str):
            raise _argument_error(f"a tensor name is a str, not {type(name).__name__}")
        e = self._set.entries.get(name)
        if e is None:
            raise _argument_error(f"{self._set.index or self._set.files[0].path}: no tensor named {name!r}")
        return e

    def get_tensor(self, name: str):
        e = self._entry(name)
        if name in self._cache:
            return self._cache.pop(name)
        return _load(self._set, [e], self._device, shard=None, mmap=self._mmap, timeout=self._timeout, progress=False,
                     label=name)[name]

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self, self._entry(name))

    def prefetch(self, names: Iterable[str] | None = None) -> None:
        """Reads ``names`` (default: every tensor) as one batch; get_tensor then hands each over without a read."""
        entries = self._set.pick(names)
        self._cache.update(_load(self._set, entries, self._device, shard=None, mmap=self._mmap, timeout=self._timeout,
                                 progress=False, label="prefetch"))

    def get_tensors(self) -> dict:
        """Every tensor, read as one batch: ``{name: tensor}``."""
        self.prefetch([n for n in self._set.entries if n not in self._cache])
        out, self._cache = self._cache, {}
        return out


def checksum(t) -> int:
    """ferry's 64-bit checksum of a contiguous tensor's bytes, computed where the tensor is."""
    import ferry
    from ._buffers import span_of, sync_torch

    s = span_of(t, writable=False, what="checksum")
    if s.nbytes == 0:
        return 0
    sync_torch([s])  # a tensor just computed on torch's stream
    return ferry.runtime().checksum(s.ptr, s.nbytes)


def save(tensors: Mapping[str, Any], path: Any, metadata: Mapping[str, str] | None = None, *,
         timeout: float | str | None = None) -> None:
    """Writes ``{name: tensor}`` as safetensors (local, os.PathLike, ferry://, or http(s):// and s3://, put whole from
    host memory), with a checksum of every tensor in the metadata. Metadata keys and values must be strings, as safetensors requires."""
    import ferry

    torch = _torch()
    path = _fspath(path)
    timeout = _timeout(timeout)
    by_dtype = {getattr(torch, v[0]): k for k, v in _DTYPES.items() if v[0] and getattr(torch, v[0], None) is not None}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise _argument_error(f"metadata[{k!r}] = {v!r}: safetensors metadata keys and values are strings")
    header, offset, parts = {}, 0, []
    sums = {}
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise _argument_error(f"tensor name {name!r} is not a str")
        if t.dtype not in by_dtype:
            raise _argument_error(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        t = t.detach().contiguous()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": by_dtype[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        sums[name] = f"{checksum(t):016x}"
        parts.append((t, offset, n))
        offset += n
    meta = dict(metadata or {})
    meta[_CHECKSUMS] = json.dumps(sums, separators=(",", ":"))
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    with ferry.open(path, "w") as f:
        if path.startswith(("http://", "https://", "s3://")):
            # These take one write of the whole file (one PUT, or S3's parts): the file is put together in host
            # memory first.
            whole = torch.empty(len(head) + offset, dtype=torch.uint8)
            whole[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
            for t, off, n in parts:
                if n:
                    whole[len(head) + off:len(head) + off + n] = t.reshape(-1).view(torch.uint8).cpu()
            f.write_from(whole, 0, timeout=timeout)
        else:
            f.write_from(head, 0, timeout=timeout)
            for t, off, n in parts:
                if n:
                    f.write_from(t, len(head) + off, timeout=timeout)
        f.sync()  # durable (and, for ferry://, committed) before save returns
