#!/usr/bin/env python3
"""A torch workload whose live tensors exceed the GPU memory it may use: a chain of large matmuls on tensors
allocated by ferry's unified memory (ferry.torch.use_unified_memory), those past the cap in host memory.

    python3 examples/python/unified_memory.py --cap 256MiB --live 512MiB    # live tensors 2x the cap
    python3 examples/python/unified_memory.py --no-ferry --live 512MiB     # the same with torch's own allocator

Prints one JSON line: seconds, the result's digest, and where ferry's pages went. --out saves the result.
"""
import argparse
import hashlib
import json
import time

import torch


def size(s):
    s = s.strip().upper()
    for u, m in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10)):
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap", default="256MiB", help="GPU memory ferry's space may use")
    ap.add_argument("--live", default="512MiB", help="bytes of live tensors (square float32 matrices of --dim)")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--no-ferry", action="store_true", help="torch's own allocator (the reference)")
    ap.add_argument("--out", help="save the result tensor here (torch.save)")
    a = ap.parse_args()
    if not a.no_ferry:
        import ferry.torch
        ferry.torch.use_unified_memory(device_capacity=size(a.cap))
    torch.backends.cuda.matmul.allow_tf32 = False  # exact float32 products: the two runs must agree bit for bit
    mat = a.dim * a.dim * 4
    n = max(2, size(a.live) // mat)
    g = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    mats = [(torch.rand(a.dim, a.dim, generator=g) / a.dim).to("cuda") for _ in range(n)]  # all live at once
    x = torch.eye(a.dim, device="cuda")
    for _ in range(2):
        for m in mats:
            x = x @ m
            x = x / x.abs().max()
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    res = x.cpu()
    out = {"ferry": not a.no_ferry, "matrices": n, "live_bytes": n * mat, "seconds": round(secs, 3),
           "digest": hashlib.sha256(res.numpy().tobytes()).hexdigest()[:16]}
    if not a.no_ferry:
        import ferry.torch
        out["space"] = ferry.torch.info()
    if a.out:
        torch.save(res, a.out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
