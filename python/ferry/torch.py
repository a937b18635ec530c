"""ferry and PyTorch: ferry's unified memory as torch's CUDA allocator.

    import ferry.torch
    ferry.torch.use_unified_memory(device_capacity="8GiB")   # before any CUDA tensor exists
    ... # the model's tensors may now total more than the cap: those past it live in host memory

Every tensor torch makes on the device then lives in one ferry address space (docs/design/unified-memory.md):
the first `device_capacity` bytes of it in GPU memory, the rest in host memory that kernels read and write in
place over PCIe (GPUs cannot fault, so nothing migrates on a kernel's access). PREFETCH through
`prefetch(tensor)` moves a tensor's pages to the GPU (evicting others past the cap). As torch's own allocator
does, freed tensors' memory is kept for the next tensors on the same stream (small tensors share 2 MiB pages,
larger ones take whole pages); `empty_cache()` gives what is kept back to the space.
"""
from __future__ import annotations

from typing import Any

from . import _ferry, runtime

__all__ = ["use_unified_memory", "info", "prefetch", "empty_cache"]

_installed = False


def _bytes(v: int | str | None) -> int:
    if v is None:
        return 0
    if isinstance(v, int):
        if v < 0:
            raise ValueError(f"device_capacity must be >= 0 bytes, not {v}")
        return v
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "B": 1}
    s = v.strip().upper()
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def use_unified_memory(device_capacity: int | str | None = None, device: int = 0) -> None:
    """Installs ferry's unified address space on cuda:`device` as torch's CUDA allocator.

    `device_capacity`: bytes of GPU memory the tensors may use (an int, or "8GiB"); None: what the GPU has free
    less FERRY_VM_RESERVE. Must run before torch makes its first CUDA tensor (torch allows one allocator per
    process); once per process.
    """
    global _installed
    import torch

    if _installed:
        raise RuntimeError("ferry.torch.use_unified_memory: already installed in this process")
    if not hasattr(torch.cuda.memory, "CUDAPluggableAllocator") or not torch.cuda.is_available():
        raise RuntimeError(
            f"ferry.torch.use_unified_memory needs torch with CUDA and torch.cuda.memory.CUDAPluggableAllocator "
            f"(torch >= 2.0) and a GPU; this is torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(_ferry.__file__, "ferry_torch_malloc", "ferry_torch_free")
    runtime().unified_setup(f"cuda:{device}", _bytes(device_capacity))
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise RuntimeError(
            "ferry.torch.use_unified_memory must run before torch makes its first CUDA tensor "
            f"(torch refused to change its allocator: {e})") from e
    _installed = True


def info() -> dict[str, Any]:
    """The unified space behind torch's tensors: device, capacity, bytes resident on the GPU, page moves, bytes
    of tensors allocated, kept for reuse and waiting for other streams before they are kept (fenced_bytes), and
    the last allocation error ferry saw (torch reports only 'out of memory')."""
    return dict(_ferry.unified_info())


def empty_cache() -> int:
    """Gives the memory kept from freed tensors back to the unified space (as ``torch.cuda.empty_cache`` does for
    torch's allocator); returns the bytes given back. An allocation that does not fit does this by itself."""
    return int(_ferry.unified_release())


def prefetch(tensor: Any, to: str = "cuda") -> None:
    """Moves a tensor's pages to the GPU ("cuda") or to host memory ("cpu"), after the work queued on the current
    stream."""
    import torch

    ptr, n = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    if n == 0:
        return
    torch.cuda.current_stream().synchronize()
    _ferry.unified_prefetch(ptr, n, to == "cuda")
