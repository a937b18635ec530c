"""What ferry needs of a caller's buffer: its address, its size and where it lives.

Accepted: torch tensors (CPU or CUDA), objects with ``__cuda_array_interface__`` (CuPy, Numba, torch),
objects with ``__dlpack__`` (JAX and others), objects with the buffer protocol (numpy arrays, bytearray,
memoryview, bytes for sources), and ferry's own buffers. Every buffer must be contiguous. The caller's object is kept in the returned
``Span`` so that its memory outlives what ferry does with it.
"""
from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

from . import _ferry


class Span(NamedTuple):
    # (A named tuple: made once per request of a batch, where a frozen dataclass cost several times as much.)
    ptr: int
    nbytes: int
    device: str  # "cpu", "cuda:N", or a ferry device id ("sim:0")
    owner: Any  # the object whose memory this is (kept alive)


def _itemsize(typestr: str) -> int:
    # '<f4', '|u1', '<c8': the size in bytes is the trailing number.
    digits = "".join(ch for ch in typestr if ch.isdigit())
    if not digits:
        raise ValueError(f"cannot tell the element size of typestr {typestr!r}")
    return int(digits)


def _c_contiguous(shape, strides, itemsize) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


# DLPack (https://dmlc.github.io/dlpack): the ABI of a DLManagedTensor, read from the capsule an object's
# __dlpack__() returns. The capsule is kept with the span and not renamed, so that the producer's deleter runs
# when ferry is done with the memory (the capsule's own destructor calls it).
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_kDLCPU, _kDLCUDA, _kDLCUDAHost = 1, 2, 3
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _dlpack_span(obj: Any, what: str) -> Span:
    capsule = obj.__dlpack__()
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))  # DLManagedTensor starts with its DLTensor
    kind = t.device.device_type
    if kind not in (_kDLCPU, _kDLCUDA, _kDLCUDAHost):
        raise TypeError(f"{what}: DLPack device type {kind} is not memory ferry can use (CPU, CUDA, CUDA host)")
    itemsize = (t.dtype.bits * t.dtype.lanes + 7) // 8
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = [t.strides[i] * itemsize for i in range(t.ndim)] if t.strides else None
    if not _c_contiguous(shape, strides, itemsize):
        raise ValueError(f"{what}: the DLPack tensor is not C-contiguous")
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    device = f"cuda:{t.device.device_id}" if kind == _kDLCUDA else "cpu"
    return Span((t.data or 0) + t.byte_offset, nbytes, device, (obj, capsule))


def span_of(obj: Any, *, writable: bool, what: str = "buffer") -> Span:
    """The memory of ``obj``; ``writable`` when ferry writes into it. Raises TypeError/ValueError naming the problem."""
    if isinstance(obj, Span):
        return obj
    if isinstance(obj, (_ferry.DeviceBuffer, _ferry.PinnedBuffer)):
        return Span(obj.ptr, obj.nbytes, obj.device, obj)
    # torch (duck-typed: no import of torch needed to use ferry)
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size") and hasattr(obj, "is_contiguous"):
        if not obj.is_contiguous():
            raise ValueError(f"{what}: the tensor is not contiguous (call .contiguous() first)")
        if writable and getattr(obj, "requires_grad", False) and obj.is_leaf:
            raise ValueError(f"{what}: the tensor requires grad; ferry would write under autograd (use .detach())")
        dev = obj.device
        where = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index if dev.index is not None else 0}"
        return Span(obj.data_ptr(), obj.numel() * obj.element_size(), where, obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        ptr, readonly = cai["data"]
        if writable and readonly:
            raise ValueError(f"{what}: the CUDA array is read-only")
        size = _itemsize(cai["typestr"])
        if not _c_contiguous(cai["shape"], cai.get("strides"), size):
            raise ValueError(f"{what}: the CUDA array is not C-contiguous")
        for dim in cai["shape"]:
            size *= dim
        device = getattr(obj, "device", None)
        ordinal = getattr(device, "id", 0) if device is not None else 0
        return Span(int(ptr), size, f"cuda:{ordinal}", obj)
    if hasattr(obj, "__dlpack__") and not hasattr(obj, "__array_interface__"):  # JAX and others (numpy takes the buffer path)
        return _dlpack_span(obj, what)
    try:
        # A memoryview held with the span keeps the object from being resized (bytearray) while ferry uses it.
        view = memoryview(obj)
        ptr, nbytes = _ferry.buffer_address(view, writable)
    except BufferError as e:
        raise ValueError(f"{what}: {e} (ferry needs a C-contiguous{' writable' if writable else ''} buffer)") from None
    except TypeError:
        raise TypeError(
            f"{what}: {type(obj).__name__} is not a buffer ferry can use: give a torch tensor, an object with "
            "__cuda_array_interface__ or the buffer protocol (numpy array, bytearray, memoryview), or a ferry.DeviceBuffer"
        ) from None
    return Span(ptr, nbytes, "cpu", (obj, view))


def sync_torch(spans) -> None:
    """Waits for the work torch queued on its current stream of each CUDA device the torch tensors among
    ``spans`` live on: ferry's own copies are not ordered after it (a fresh tensor's memory may still be in
    use by kernels queued before it was freed; a tensor just computed may not be written yet)."""
    done = set()
    for s in spans:
        o = s.owner
        dev = getattr(o, "device", None)
        if getattr(dev, "type", None) == "cuda" and dev.index not in done and hasattr(o, "data_ptr"):
            import torch

            torch.cuda.current_stream(dev).synchronize()
            done.add(dev.index)


def stream_device(stream: Any) -> str | None:
    """The device of a torch/CuPy stream ("cuda:N"), if it says."""
    dev = getattr(stream, "device", None)
    if getattr(dev, "type", None) == "cuda":
        return f"cuda:{dev.index if dev.index is not None else 0}"
    for attr in ("device_id",):  # cupy
        d = getattr(stream, attr, None)
        if isinstance(d, int):
            return f"cuda:{d}"
    return None


def stream_handle(stream: Any) -> int | None:
    """The CUstream of a torch/CuPy stream, or an int handle; None for no stream."""
    if stream is None:
        return None
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):  # torch.cuda.Stream, cupy.cuda.Stream, others
        h = getattr(stream, attr, None)
        if isinstance(h, int):
            return h
    raise TypeError(f"stream: {type(stream).__name__} has no CUDA stream handle (give a torch or CuPy stream, or an int)")
