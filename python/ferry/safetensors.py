"""safetensors checkpoints straight into their final memory.

``load`` parses the header, makes every tensor where it belongs (``device=``) and reads all of their bytes in
one batch of the file engine (pipelined over its I/O threads, through pinned staging for GPU memory): no copy
of the file in host memory. Local paths and ``ferry://host:port/path`` alike. ``shard=Shard(rank, world, dim)``
reads only a rank's slice of each tensor. ``save`` writes a file safetensors reads, with a checksum of every
tensor in its metadata, which ``load(..., verify=True)`` checks.
"""
from __future__ import annotations

import json
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from . import _ferry

_DTYPES = {  # safetensors name -> torch attribute, element size
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8), "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}
_CHECKSUMS = "ferry.checksum64"  # __metadata__ key: JSON object, tensor name -> hex checksum of its bytes


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world`` reads the ``rank``-th of ``world`` equal slices of each tensor along ``dim``
    (an int for every tensor, or a function name -> dim or None; None: the whole tensor). A dimension that
    ``world`` does not divide is an error naming the tensor."""
    rank: int
    world: int
    dim: int | Callable[[str], int | None] = 0

    def dim_of(self, name: str) -> int | None:
        return self.dim(name) if callable(self.dim) else self.dim


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the tests have torch
        raise ImportError("ferry.safetensors needs torch") from e
    return torch


def _dtype(torch, name: str, tensor: str):
    entry = _DTYPES.get(name)
    dt = getattr(torch, entry[0], None) if entry else None
    if dt is None:
        raise ValueError(f"tensor {tensor!r}: dtype {name} is not one this torch ({torch.__version__}) has")
    return dt, entry[1]


def read_header(f) -> tuple[dict, int]:
    """The header of an open ferry.File and the offset of its data section."""
    head = bytearray(8)
    if f.read_into(head, 0) != 8:
        raise ValueError(f"{f.path}: {f.size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > 100 << 20 or 8 + n > f.size:
        raise ValueError(f"{f.path}: header length {n} does not fit the file's {f.size} bytes")
    raw = bytearray(n)
    f.read_into(raw, 8)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f.path}: the header is not JSON: {e}") from None
    return header, 8 + n


class _Progress:
    """A progress line on a terminal: tqdm if installed, else a plain one; nothing when not a terminal."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.bar = None
        self.plain = False
        self.total, self.label, self.last = total, label, 0.0
        if not enabled or not sys.stderr.isatty():
            return
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=label)
        except ImportError:
            self.plain = True

    def update(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        elif self.plain and time.monotonic() - self.last > 0.2:
            self.last = time.monotonic()
            sys.stderr.write(f"\r{self.label}: {done / 2**20:.0f} / {self.total / 2**20:.0f} MiB")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.plain:
            sys.stderr.write("\n")


def load(path: str, device: Any = "cpu", names: Iterable[str] | None = None, *, shard: Shard | None = None,
         progress: bool = True, verify: bool = False, timeout: float | None = None) -> dict:
    """Loads a safetensors file (local or ferry://) into tensors on ``device``: ``{name: tensor}``."""
    import ferry

    torch = _torch()
    dev = torch.device(device)
    with ferry.open(path) as f:
        header, data_start = read_header(f)
        meta = header.pop("__metadata__", None) or {}
        wanted = list(header) if names is None else list(names)
        missing = [n for n in wanted if n not in header]
        if missing:
            raise KeyError(f"{path}: no tensor named {', '.join(map(repr, missing[:5]))}" + (" ..." if len(missing) > 5 else ""))
        out, requests = {}, []
        for name in wanted:
            info = header[name]
            dt, size = _dtype(torch, info["dtype"], name)
            shape = list(info["shape"])
            begin, end = info["data_offsets"]
            count = 1
            for d in shape:
                count *= d
            if end - begin != count * size:
                raise ValueError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape} of {info['dtype']}")
            if begin < 0 or data_start + end > f.size:
                raise ValueError(f"{path}: tensor {name!r} lies at [{data_start + begin}, {data_start + end}), past the end "
                                 f"of the file ({f.size} bytes): the file is cut short")
            dim = shard.dim_of(name) if shard else None
            if dim is None or not shape:
                t = torch.empty(shape, dtype=dt, device=dev)
                out[name] = t
                if count:
                    requests.append((f, data_start + begin, t))
                continue
            dim = dim % len(shape)
            if shape[dim] % shard.world:
                raise ValueError(f"{path}: tensor {name!r} dim {dim} of size {shape[dim]} does not split into {shard.world} ranks")
            part = shape[dim] // shard.world
            local = shape[:dim] + [part] + shape[dim + 1:]
            t = torch.empty(local, dtype=dt, device=dev)
            out[name] = t
            inner = size
            for d in shape[dim + 1:]:
                inner *= d
            outer = 1
            for d in shape[:dim]:
                outer *= d
            block = part * inner  # bytes of this rank's slice per outer index: contiguous in the file
            if block == 0:
                continue
            flat = t.view(-1).view(torch.uint8)
            for i in range(outer):
                src = data_start + begin + i * shape[dim] * inner + shard.rank * block
                requests.append((f, src, flat[i * block:(i + 1) * block]))
        total = sum(r[2].numel() * r[2].element_size() for r in requests)
        if timeout is None:
            # One deadline for the whole load: FERRY_DEADLINE, plus the time to move it at 100 MB/s.
            timeout = _seconds(ferry.settings().get("FERRY_DEADLINE", "30s")) + total / 100e6
        bar = _Progress(total, f"ferry load {path}", progress)
        try:
            with ferry.read_batch(requests, timeout=timeout) as batch:
                while not batch.done():
                    batch.wait(0.1)
                    bar.update(batch.bytes_done)
                bar.update(batch.bytes_done)
                batch.check()
                for (_, off, buf), res in zip(requests, batch.results()):
                    want = buf.numel() * buf.element_size()
                    if res["bytes_done"] != want:  # the file was cut short after its size was read
                        raise ValueError(f"{path}: read {res['bytes_done']} of {want} bytes at offset {off}: the file is cut short")
        finally:
            bar.close()
        if verify:
            sums = json.loads(meta.get(_CHECKSUMS, "{}"))
            if not sums:
                raise ValueError(f"{path}: verify=True but the file has no {_CHECKSUMS} metadata (save it with ferry.safetensors.save)")
            for name in wanted:
                if shard and shard.dim_of(name) is not None:
                    continue  # a slice: the file's checksum is of the whole tensor
                if name not in sums:
                    raise ValueError(f"{path}: verify=True but tensor {name!r} has no checksum in {_CHECKSUMS}")
                got = checksum(out[name])
                if f"{got:016x}" != sums[name]:
                    raise ValueError(f"{path}: tensor {name!r} checksum {got:016x} != {sums[name]} in the file")
        return out


def _seconds(text: str) -> float:
    units = {"ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
    for u in sorted(units, key=len, reverse=True):
        if text.endswith(u):
            return float(text[: -len(u)]) * units[u]
    return float(text)


def checksum(t) -> int:
    """ferry's 64-bit checksum of a contiguous tensor's bytes, computed where the tensor is."""
    import ferry
    from ._buffers import span_of, sync_torch

    s = span_of(t, writable=False, what="checksum")
    if s.nbytes == 0:
        return 0
    sync_torch([s])  # a tensor just computed on torch's stream
    return ferry.runtime().checksum(s.ptr, s.nbytes)


def save(tensors: Mapping[str, Any], path: str, metadata: Mapping[str, str] | None = None, *, timeout: float | None = None) -> None:
    """Writes ``{name: tensor}`` as safetensors (local or ferry://), with a checksum of every tensor in the metadata."""
    import ferry

    torch = _torch()
    by_dtype = {getattr(torch, v[0], None): k for k, v in _DTYPES.items() if getattr(torch, v[0], None) is not None}
    header, offset, parts = {}, 0, []
    sums = {}
    for name, t in tensors.items():
        if t.dtype not in by_dtype:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
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
        f.write_from(head, 0, timeout=timeout)
        for t, off, n in parts:
            if n:
                f.write_from(t, len(head) + off, timeout=timeout)
        f.sync()  # durable (and, for ferry://, committed) before save returns
