"""Hugging Face transformers models with their weights read by ferry.

    model = ferry.transformers.from_pretrained("path/to/model", device="cuda:0", dtype=torch.bfloat16)

builds the model the way ``AutoModelForCausalLM.from_pretrained(path, device_map=device, dtype=dtype)`` does (its
config, its class; its parameters empty, on the meta device, and its buffers computed on the CPU, as
from_pretrained makes them, the buffers then moved to the device) while ferry reads the checkpoint's shards into
their final device memory on its own threads, then hands the model those tensors (no copy). The logits equal
``from_pretrained``'s. transformers is imported only when this is called.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any


@contextlib.contextmanager
def _empty_parameters():
    """Parameters that modules made on this thread register go to the meta device: neither their memory nor their
    random initialization is paid for, since the checkpoint's tensors replace them. Buffers (a rotary
    embedding's frequencies, computed when the module is made) stay where they were made. Modules made on other
    threads meanwhile are left alone. Made on the CPU (no device context), a parameter's tensor before it goes
    to meta is an untouched allocation; on a GPU it would be a device allocation per parameter."""
    import torch

    register = torch.nn.Module.register_parameter
    me = threading.get_ident()

    def register_empty(module, name, param):
        register(module, name, param)
        if param is not None and threading.get_ident() == me and param.device.type != "meta":
            empty = param.to("meta")
            try:  # the parameter's own class (and what it carries), as transformers and accelerate keep it
                module._parameters[name] = type(param)(empty, requires_grad=param.requires_grad)
            except TypeError:
                module._parameters[name] = torch.nn.Parameter(empty, requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_empty
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _buffers_to(model, device) -> None:
    """Every buffer of `model` onto `device` (from_pretrained computes them on the CPU too and moves them)."""
    import torch

    device = torch.device(device)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def from_pretrained(path: str | os.PathLike, *, device: Any = "cuda:0", dtype: Any = None, model_class: Any = None,
                    timeout: float | str | None = None, **config_kwargs):
    """A transformers model from a ``save_pretrained`` folder (local, or a folder ferry can read), on ``device``.
    ``model_class``: the transformers class (default ``AutoModelForCausalLM``); ``config_kwargs`` go to
    ``AutoConfig.from_pretrained``. A parameter the checkpoint lacks (other than tied ones) is a
    ``ferry.FormatError``."""
    import torch
    import transformers

    from . import FormatError, safetensors

    config = transformers.AutoConfig.from_pretrained(path, **config_kwargs)
    cls = model_class or transformers.AutoModelForCausalLM
    loaded: dict = {}

    def read():
        try:
            loaded["tensors"] = safetensors.load(path, device=device, progress=False, timeout=timeout)
        except BaseException as e:  # handed to the caller below
            loaded["error"] = e

    # The shards move while transformers builds the model: the two costs overlap instead of adding up.
    reader = threading.Thread(target=read, name="ferry-from_pretrained")
    reader.start()
    try:
        with _empty_parameters():
            model = cls.from_config(config, dtype=dtype) if dtype is not None else cls.from_config(config)
        _buffers_to(model, device)
    finally:
        reader.join()
    if "error" in loaded:
        raise loaded["error"]
    tensors = loaded["tensors"]
    if dtype is not None:  # as from_pretrained does: floating-point weights in the asked dtype
        tensors = {k: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for k, t in tensors.items()}
    _, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    held = {t.data_ptr() for t in tensors.values()}
    untouched = [n for n, p in model.named_parameters() if p.data_ptr() not in held]
    if untouched or unexpected:
        e = FormatError(f"{os.fspath(path)}: the checkpoint does not fit {type(model).__name__}: "
                        f"parameters it lacks {untouched[:5]}, tensors the model lacks {list(unexpected)[:5]}")
        e.code = "invalid_format"
        raise e
    return model.eval()
