#!/usr/bin/env python3
"""Tensor-parallel loading as serving runs it: one fresh process per GPU (torchrun), each rank its slices.

    torchrun --nproc-per-node 4 bench/python/tp_load.py --dir /tmp/ferry-tp --size 8GiB --rounds 3

Rank 0 writes once a checkpoint of LLM shapes (Llama-7B layers in bf16, several shard files and an index). Then,
warm and with the page cache dropped, alternating, --rounds times:

  safetensors:  per rank, safe_open(shard, device=its GPU) and get_slice(name)[its slice] for every tensor
  ferry:        ferry.safetensors.load(folder, its GPU, shard=Shard(rank, world, rule), group=WORLD)

The time is until the slowest rank holds its tensors; the bytes read from the file system are summed over the
ranks (ferry's own count; safetensors reads through mmap and is not counted); every rank's tensors are compared
with safetensors'. A third row loads the same bytes split along dim 0 only, for the dim-1 target. Targets (issue
52): ferry >= 3x faster warm; bytes read per node = the checkpoint's data; cold >= 0.95x the disk's ceiling for
the node; dim-1 slices within 0.9x of the dim-0 split.
"""
import argparse
import json
import math
import os
import re
import time

import torch
import torch.distributed as dist

import ferry
from ferry.safetensors import _DTYPES, Shard
from load_checkpoint import ceiling

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def tp_dim(name: str, shape) -> int | None:
    """Megatron's split: column-parallel weights along dim 0, row-parallel along dim 1, the rest whole."""
    if len(shape) != 2:
        return None
    if any(k in name for k in ROW):
        return 1
    if any(k in name for k in COLUMN):
        return 0
    return None


def make(folder: str, size: int, device: str) -> None:
    # Llama-7B's shapes; a small run (under 1 GiB) the same layout at 1/16 of the width.
    h, f, vocab = (4096, 11008, 32000) if size >= 1 << 30 else (256, 688, 2000)
    per_shard = min(2 << 30, max(size // 4, 1 << 20))
    layer = (4 * h * h + 3 * f * h) * 2 + 2 * h * 2
    layers = max(2, (size - 2 * vocab * h * 2) // layer)
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(1)
    shard, shards, weight_map, held = {}, [], {}, 0

    def flush():
        nonlocal shard, held
        name = f"model-{len(shards) + 1:05d}.safetensors"
        ferry.safetensors.save(shard, os.path.join(folder, name), {"format": "pt"})
        weight_map.update({k: name for k in shard})
        shards.append(name)
        shard, held = {}, 0

    def add(name, *shape):
        nonlocal held
        shard[name] = torch.randn(*shape, generator=g, device=device).to(torch.bfloat16)
        held += shard[name].numel() * 2
        if held >= per_shard:
            flush()

    add("model.embed_tokens.weight", vocab, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            add(p + f"self_attn.{n}.weight", h, h)
        add(p + "mlp.gate_proj.weight", f, h)
        add(p + "mlp.up_proj.weight", f, h)
        add(p + "mlp.down_proj.weight", h, f)
        add(p + "input_layernorm.weight", h)
        add(p + "post_attention_layernorm.weight", h)
    add("model.norm.weight", h)
    add("lm_head.weight", vocab, h)
    if shard:
        flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)


def files_of(folder):
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def drop_cache(folder):
    for p in files_of(folder):
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    if os.geteuid() == 0:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")


def with_safetensors(folder, device, rank, world, rule, smoke=False):
    try:
        from safetensors import safe_open
    except ImportError:
        if not smoke:
            raise
        from ferry.safetensors import safe_open  # the same API, for a smoke run where safetensors is missing
    out = {}
    for p in files_of(folder):
        with safe_open(p, framework="pt", device=device) as f:
            for k in f.keys():
                s = f.get_slice(k)
                shape = s.get_shape()
                d = rule(k, shape)
                if d is None:
                    out[k] = s[:]
                    continue
                part = shape[d] // world
                idx = [slice(None)] * len(shape)
                idx[d] = slice(rank * part, (rank + 1) * part)
                out[k] = s[tuple(idx)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/ferry-tp")
    ap.add_argument("--size", default="8GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="a smoke run of this script: CPU tensors, gloo")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = "cpu" if a.cpu else f"cuda:{local}"
    if not a.cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if a.cpu else "nccl")
    m = re.fullmatch(r"(\d+)([MG])iB", a.size)
    size = int(m.group(1)) << (30 if m.group(2) == "G" else 20) if m else int(a.size)
    if rank == 0 and not os.path.exists(os.path.join(a.dir, "model.safetensors.index.json")):
        t0 = time.perf_counter()
        make(a.dir, size, device)
        print(f"checkpoint {a.dir}: written in {time.perf_counter() - t0:.1f} s", flush=True)
    dist.barrier()
    with ferry.safetensors.safe_open(a.dir, framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        bits = {k: _DTYPES[f.get_slice(k).get_dtype()][1] for k in f.keys()}
    data = sum(math.prod(s) * bits[k] // 8 for k, s in shapes.items())  # the tensors' bytes (headers aside)
    ceiling_gbps = 0.0
    if a.rounds and local == 0:  # the node's disk, read by O_DIRECT threads: the cold rows' ceiling
        drop_cache(a.dir)
        ceiling_gbps = sum(os.path.getsize(p) for p in files_of(a.dir)) / sum(
            os.path.getsize(p) / (ceiling(p) * 1e9) for p in files_of(a.dir)) / 1e9
        print(f"disk ceiling (O_DIRECT, 16 threads, 8 MiB, file by file): {ceiling_gbps:.2f} GB/s", flush=True)
    dims = {k: tp_dim(k, s) for k, s in shapes.items()}
    dims0 = {k: (0 if d is not None else None) for k, d in dims.items()}
    tp = Shard(rank, world, lambda name: dims[name])
    tp0 = Shard(rank, world, lambda name: dims0[name])
    rows = {}

    def sync():
        if not a.cpu:
            torch.cuda.synchronize()

    def timed(fn):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        t = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return out, t.item()

    def row(key, seconds, note=""):
        rows.setdefault(key, []).append(seconds)
        if rank == 0:
            print(f"  {key:<44} {seconds:7.3f} s {data / seconds / 1e9:7.2f} GB/s of checkpoint  {note}", flush=True)

    ok = True
    for kind in ("warm", "cold"):
        for r in range(a.rounds):
            if rank == 0:
                print(f"# {kind}, round {r + 1}", flush=True)
            ways = [("safetensors safe_open+get_slice", lambda: with_safetensors(a.dir, device, rank, world, lambda k, s: dims[k], a.cpu)),
                     ("ferry cooperative", lambda: ferry.safetensors.load(a.dir, device, shard=tp, group=dist.group.WORLD,
                                                                          progress=False, stats=stats)),
                     ("ferry cooperative, all along dim 0", lambda: ferry.safetensors.load(a.dir, device, shard=tp0,
                                                                                           group=dist.group.WORLD, progress=False))]
            ref = None
            for name, fn in ways:
                if kind == "cold":
                    if local == 0:
                        drop_cache(a.dir)
                stats = {}
                got, s = timed(fn)
                note = ""
                if name == "safetensors safe_open+get_slice":
                    ref = got
                elif name == "ferry cooperative":
                    same = torch.tensor([int(set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref))], device=device)
                    dist.all_reduce(same, op=dist.ReduceOp.MIN)
                    read = torch.tensor([stats["bytes_read"]], device=device, dtype=torch.int64)
                    dist.all_reduce(read)
                    ok = ok and bool(same.item())
                    note = f"equal to safetensors: {bool(same.item())}; read by the node {read.item() / 2**30:.3f} GiB of {data / 2**30:.3f}"
                    rows.setdefault(f"{kind} bytes read", []).append(read.item())
                row(f"{kind} {name}", s, note)
                del got
            del ref
    if rank == 0:
        med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
        print("# targets (medians)")
        for what, v, want in [
            ("warm: safetensors time / ferry's", med["warm safetensors safe_open+get_slice"] / med["warm ferry cooperative"], 3.0),
            ("cold: ferry's rate / the disk's ceiling for the node", data / med["cold ferry cooperative"] / 1e9 / ceiling_gbps, 0.95),
            ("warm: dim-0 split time / the TP split's (dim-1 slices)", med["warm ferry cooperative, all along dim 0"] / med["warm ferry cooperative"], 0.9),
            ("bytes read per node / checkpoint bytes (warm)", med["warm bytes read"] / data, 1.0),
        ]:
            print(f"  {what}: {v:.2f} (want >= {want}) {'PASS' if v >= want else 'MISS'}")
        print("every rank's tensors equal to safetensors' slices:", "yes" if ok else "NO")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
