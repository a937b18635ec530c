#!/usr/bin/env python3
"""Offload KV-cache blocks from GPU memory to a file (or ferry://host:port/path) and restore them into other
slots, the way a serving engine swaps out a paused request's cache: one write batch, one read batch.

    python3 examples/python/kv_cache_offload.py /tmp/kv.bin
    python3 examples/python/kv_cache_offload.py ferry://127.0.0.1:7070/kv.bin --blocks 512

The cache is a pool of fixed-size blocks (as vLLM's paged attention keeps it); a request's blocks are scattered
over the pool. Runs on the CPU too (a torch CPU tensor as the pool) when there is no GPU.
"""
import argparse
import time

import torch

import ferry


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", help="file path or ferry:// URI to offload to")
    ap.add_argument("--blocks", type=int, default=256, help="blocks in the pool")
    ap.add_argument("--block-kib", type=int, default=256, help="bytes per block, KiB (layers x heads x tokens x dim x 2)")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    ferry.runtime()  # made once per process (devices, I/O threads): not part of the timings
    block = a.block_kib << 10
    pool = torch.randint(0, 256, (a.blocks, block), dtype=torch.uint8, device=a.device)
    g = torch.Generator().manual_seed(3)
    request = torch.randperm(a.blocks, generator=g)[: a.blocks // 4].tolist()  # one request's scattered blocks
    saved = pool[request].clone()

    t0 = time.perf_counter()
    with ferry.open(a.target, "w") as f:
        # Block i of the request goes to offset i * block of the file.
        with ferry.write_batch([(f, i * block, pool[b]) for i, b in enumerate(request)]) as batch:
            batch.check()
        f.sync()
    out_s = time.perf_counter() - t0

    pool[request] = 0  # the slots go to other requests
    free = [b for b in range(a.blocks) if b not in set(request)][: len(request)]  # restored into other slots
    t0 = time.perf_counter()
    with ferry.open(a.target) as f:
        with ferry.read_batch([(f, i * block, pool[b]) for i, b in enumerate(free)]) as batch:
            batch.check()
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    in_s = time.perf_counter() - t0
    assert torch.equal(pool[free], saved), "restored blocks differ"
    n = len(request) * block
    print(f"{len(request)} blocks of {a.block_kib} KiB ({n / 2**20:.0f} MiB) on {a.device}: offloaded in {out_s * 1e3:.1f} ms, "
          f"restored into other slots in {in_s * 1e3:.1f} ms, verified")


if __name__ == "__main__":
    main()
