#!/usr/bin/env python3
"""Tensor-parallel loading as serving runs it: one fresh process per GPU (torchrun), each rank its slices.

    for r in 1 2 3; do for f in ferry safetensors; do
      torchrun --nproc-per-node 4 bench/python/tp_load.py --size 8GiB --first $f --results tp.jsonl; done; done
    python3 bench/python/tp_load.py --summary tp.jsonl

Rank 0 writes once a checkpoint of LLM shapes (Llama-7B layers in bf16, several shard files and an index). Each
launch is one round in fresh processes, each way once warm, then ferry's first and safetensors with the page
cache dropped:

  ferry:        ferry.safetensors.load(folder, its GPU, shard=Shard(rank, world, rule), group=WORLD)
  ferry dim 0:  the same bytes split along dim 0 only (the dim-1 target's comparison)
  ferry again:  the first way again, after the process's first load as the dim-0 row is
  safetensors:  per rank, safe_open(shard, device=its GPU) and get_slice(name)[its slice] for every tensor

A user's rank loads once, in a process that has loaded nothing: whichever way goes first pays the process's first
CUDA allocations and the like. So `--first ferry` (the default) runs the four in the order above, warm and cold,
and `--first safetensors` runs safetensors first and then ferry's three, warm only; the loader script alternates
them. The warm target compares each way's load as the first of its process (medians over the launches that made
it first); the ratio with safetensors after ferry in the same process is printed beside it.

The time is until the slowest rank holds its tensors; every rank's tensors are compared with safetensors'. The
bytes read from the file system by the node are ferry's own count, summed over the ranks; with the page cache
dropped, also what the kernel fetched from storage for every rank (/proc/self/io `read_bytes`, readahead included). --summary prints the medians
over the launches against the targets (issue 52): ferry >= 3x faster warm; bytes read per node = the checkpoint's
data; cold >= 0.95x the disk's ceiling for the node; dim-1 slices within 0.9x of the dim-0 split.
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


def warm_cache(folder):
    """Every shard read once through the page cache (the disk ceiling's O_DIRECT reads leave it cold)."""
    for p in files_of(folder):
        with open(p, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


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


def storage_read() -> int:
    """Bytes this process (its io_uring workers included: they are its threads) made the kernel fetch from storage."""
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("read_bytes:")).split()[1])


def summary(path: str) -> int:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no rounds")
    meta = rows[0]
    data, ceiling_gbps = meta["data"], meta["ceiling_gbps"]
    ferry_first = [r for r in rows if r.get("first", "ferry") == "ferry"]
    st_first = [r for r in rows if r.get("first") == "safetensors"]
    if not ferry_first:
        raise SystemExit(f"{path}: no launch made ferry's load first")

    def median(launches, k):
        v = sorted(r["rows"][k] for r in launches)
        return v[len(v) // 2]

    med = {k: median(ferry_first, k) for k in ferry_first[0]["rows"]}
    print(f"# {len(ferry_first)} launches with ferry's load first, world {meta['world']}, "
          f"{data / 2**30:.2f} GiB of tensors; medians:")
    for k, v in med.items():
        print(f"  {k:<52} {v:9.3f}")
    targets = []
    if st_first:
        st = {k: median(st_first, k) for k in st_first[0]["rows"]}
        print(f"# {len(st_first)} launches with safetensors' load first; medians:")
        for k, v in st.items():
            print(f"  {k:<52} {v:9.3f}")
        print(f"  (safetensors after ferry's loads in the same process / ferry's first: "
              f"{med['warm safetensors s'] / med['warm ferry s']:.3f})")
        targets.append(("warm: safetensors' first load of a process / ferry's first", st["warm safetensors s"] / med["warm ferry s"], 3.0, None))
    else:  # launches from before --first: safetensors ran after ferry's loads
        targets.append(("warm: safetensors time (after ferry's loads) / ferry's", med["warm safetensors s"] / med["warm ferry s"], 3.0, None))
    ok = all(r["equal"] for r in rows)
    for what, v, lo, hi in targets + [
        ("cold: ferry's rate / the disk's ceiling for the node",
         data / med["cold ferry s"] / 1e9 / ceiling_gbps if ceiling_gbps else 0.0, 0.95, None),
        # Both loads after the process's first (the runtime made): only the split differs.
        ("warm: dim-0 split time / the TP split's (dim-1 slices)", med["warm ferry dim 0 s"] / med["warm ferry again s"], 0.9, None),
        # Once per node: the file's bytes and no more (headers and readahead at the ends aside).
        ("bytes read per node / checkpoint bytes (warm, ferry's count)", med["warm ferry bytes read"] / data, 0.99, 1.01),
        ("bytes from storage per node / checkpoint bytes (cold, /proc read_bytes)", med["cold ferry from storage"] / data, 0.99, 1.05),
    ]:
        good = v >= lo and (hi is None or v <= hi)
        print(f"  {what}: {v:.3f} (want >= {lo}{f' and <= {hi}' if hi else ''}) {'PASS' if good else 'MISS'}")
    print("every rank's tensors equal to safetensors' slices in every launch:", "yes" if ok else "NO")
    return 0 if ok else 1


def one_process(a) -> int:
    """One process, N devices (issue 52's fourth item), warm, 3 alternating rounds: ferry.safetensors.load_shards
    against ferry.safetensors.load with each device's Shard in turn (what a user without load_shards writes) and
    safetensors' safe_open + get_slice per device; every device's tensors compared with safetensors'."""
    world = a.one_process
    devices = ["cpu"] * world if a.cpu else [f"cuda:{i}" for i in range(world)]
    m = re.fullmatch(r"(\d+)([MG])iB", a.size)
    size = int(m.group(1)) << (30 if m.group(2) == "G" else 20) if m else int(a.size)
    if not os.path.exists(os.path.join(a.dir, "model.safetensors.index.json")):
        make(a.dir, size, devices[0])
    with ferry.safetensors.safe_open(a.dir, framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    dims = {k: tp_dim(k, s) for k, s in shapes.items()}
    warm_cache(a.dir)

    def sync():
        if not a.cpu:
            for d in devices:
                torch.cuda.synchronize(d)

    ways = {
        "ferry load_shards": lambda: ferry.safetensors.load_shards(a.dir, devices, lambda n: dims[n], progress=False),
        "ferry load per device": lambda: [ferry.safetensors.load(a.dir, d, shard=Shard(r, world, lambda n: dims[n]),
                                                                 progress=False) for r, d in enumerate(devices)],
        "safetensors per device": lambda: [with_safetensors(a.dir, d, r, world, lambda k, s: dims[k], a.cpu)
                                           for r, d in enumerate(devices)],
    }
    times = {k: [] for k in ways}
    ok = True
    for r in range(3):
        got = {}
        for name, fn in ways.items():
            sync()
            t0 = time.perf_counter()
            got[name] = fn()
            sync()
            times[name].append(time.perf_counter() - t0)
            print(f"  round {r + 1} {name:<24} {times[name][-1]:7.3f} s", flush=True)
        ref = got["safetensors per device"]
        for name in ("ferry load_shards", "ferry load per device"):
            ok = ok and all(set(g) == set(w) and all(torch.equal(g[k], w[k]) for k in w) for g, w in zip(got[name], ref))
        del got, ref
    med = {k: sorted(v)[1] for k, v in times.items()}
    print(f"# one process, {world} devices, medians: " + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()))
    print(f"  load_shards vs per-device loads: {med['ferry load per device'] / med['ferry load_shards']:.2f}x faster; "
          f"vs safetensors: {med['safetensors per device'] / med['ferry load_shards']:.2f}x")
    print("every device's tensors equal to safetensors' slices:", "yes" if ok else "NO")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/ferry-tp")
    ap.add_argument("--size", default="8GiB")
    ap.add_argument("--results", default="/tmp/ferry-tp.jsonl", help="each launch appends its round here")
    ap.add_argument("--summary", metavar="JSONL", help="print the medians of the launches in JSONL, and exit")
    ap.add_argument("--cpu", action="store_true", help="a smoke run of this script: CPU tensors, gloo")
    ap.add_argument("--first", choices=("ferry", "safetensors"), default="ferry",
                    help="the way whose load is the process's first (safetensors: warm rows only)")
    ap.add_argument("--one-process", type=int, metavar="N",
                    help="no torchrun: one process loads every device's slices for N devices, and exits")
    a = ap.parse_args()
    if a.summary:
        raise SystemExit(summary(a.summary))
    if a.one_process:
        raise SystemExit(one_process(a))
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
    first = not os.path.exists(a.results)
    if first and local == 0:  # the node's disk, read by O_DIRECT threads: the cold rows' ceiling (once)
        drop_cache(a.dir)
        ceiling_gbps = sum(os.path.getsize(p) for p in files_of(a.dir)) / sum(
            os.path.getsize(p) / (ceiling(p) * 1e9) for p in files_of(a.dir)) / 1e9
        print(f"disk ceiling (O_DIRECT, 16 threads, 8 MiB, file by file): {ceiling_gbps:.2f} GB/s", flush=True)
    elif local == 0:
        ceiling_gbps = json.loads(open(a.results).readline())["ceiling_gbps"]
    dims = {k: tp_dim(k, s) for k, s in shapes.items()}
    dims0 = {k: (0 if d is not None else None) for k, d in dims.items()}
    tp = Shard(rank, world, lambda name: dims[name])
    tp0 = Shard(rank, world, lambda name: dims0[name])
    rows = {}

    def sync():
        if not a.cpu:
            torch.cuda.synchronize()

    def total(v, dtype=torch.float64, op=dist.ReduceOp.SUM):
        t = torch.tensor([v], device=device, dtype=dtype)
        dist.all_reduce(t, op=op)
        return t.item()

    def timed(fn):
        dist.barrier()
        sync()
        c0 = storage_read()
        t0 = time.perf_counter()
        out = fn()
        sync()
        s = total(time.perf_counter() - t0, op=dist.ReduceOp.MAX)
        return out, s, total(storage_read() - c0, torch.int64)

    ways = [("ferry", lambda: ferry.safetensors.load(a.dir, device, shard=tp, group=dist.group.WORLD,
                                                    progress=False, stats=stats)),
            ("ferry dim 0", lambda: ferry.safetensors.load(a.dir, device, shard=tp0, group=dist.group.WORLD,
                                                          progress=False)),
            ("ferry again", lambda: ferry.safetensors.load(a.dir, device, shard=tp, group=dist.group.WORLD,
                                                          progress=False)),
            ("safetensors", lambda: with_safetensors(a.dir, device, rank, world, lambda k, s: dims[k], a.cpu))]
    if a.first == "safetensors":
        ways = ways[3:] + ways[:3]
    equal = True
    for kind in ("warm", "cold") if a.first == "ferry" else ("warm",):
        if rank == 0:
            print(f"# {kind}, {a.first} first", flush=True)
        if kind == "warm" and local == 0:
            warm_cache(a.dir)
        got = {}
        for name, fn in ways:
            if kind == "cold" and name in ("ferry dim 0", "ferry again"):
                continue  # the cold target is the first load's; the split comparison is warm
            if kind == "cold":
                dist.barrier()
                if local == 0:
                    drop_cache(a.dir)
            stats = {}
            out, s, read = timed(fn)
            rows[f"{kind} {name} s"] = s
            note = f"from storage {read / 2**30:.3f} GiB"
            if name == "ferry":
                rows[f"{kind} ferry bytes read"] = total(stats["bytes_read"], torch.int64)
                rows[f"{kind} ferry from storage"] = read
                note += f", ferry's count {rows[f'{kind} ferry bytes read'] / 2**30:.3f} GiB (of {data / 2**30:.3f})"
            if name in ("ferry", "safetensors"):
                got[name] = out
            del out
            if rank == 0:
                print(f"  {name:<14} {s:7.3f} s {data / s / 1e9:7.2f} GB/s of checkpoint  {note}", flush=True)
        ref, mine = got["safetensors"], got["ferry"]
        same = int(set(mine) == set(ref) and all(torch.equal(mine[k], ref[k]) for k in ref))
        equal = equal and bool(total(same, torch.int64, dist.ReduceOp.MIN))
        del got, ref, mine
    if rank == 0:
        print("every rank's tensors equal to safetensors' slices:", "yes" if equal else "NO", flush=True)
        with open(a.results, "a") as fh:
            fh.write(json.dumps({"world": world, "first": a.first, "data": data, "ceiling_gbps": ceiling_gbps, "rows": rows,
                                 "equal": equal}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
