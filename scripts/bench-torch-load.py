#!/usr/bin/env python3
"""What users do today to load a file onto the GPU, measured cold and warm on the same file that
`ferry-bench file` reads (a safetensors file with one U8 tensor):

  torch.from_file(path, size=N, dtype=torch.uint8).cuda()
  safetensors.torch.load_file(path, device="cuda:0")

Cold: the file's pages are dropped from the page cache first (posix_fadvise DONTNEED, plus
/proc/sys/vm/drop_caches as root). Each measurement prints one JSON line
{"what", "kind", "gbps", "note"}; `ferry-bench file --compare-script` reads them.
"""
import argparse
import json
import os
import time


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if os.geteuid() == 0:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def emit(what, kind, nbytes, seconds, note=""):
    print(json.dumps({"what": what, "kind": kind, "gbps": nbytes / seconds / 1e9, "note": note}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    import torch
    size = os.path.getsize(args.path)
    dev = torch.device(args.device)
    torch.cuda.init()
    torch.empty(1, device=dev)  # create the context outside the timings

    def from_file():
        t = torch.from_file(args.path, shared=False, size=size, dtype=torch.uint8)
        g = t.to(dev)
        torch.cuda.synchronize(dev)
        return g

    loaders = [("torch.from_file(...).cuda()", from_file)]
    try:
        import safetensors.torch as st

        def load_st():
            d = st.load_file(args.path, device=args.device)
            torch.cuda.synchronize(dev)
            return d

        loaders.append(("safetensors load_file(device=cuda)", load_st))
    except ImportError as e:
        print(f"safetensors not available: {e}", flush=True)

    for name, fn in loaders:
        drop_cache(args.path)
        t0 = time.perf_counter()
        r = fn()
        emit(name, "cold", size, time.perf_counter() - t0)
        del r
        torch.cuda.empty_cache()
        best = 0.0
        for _ in range(3):  # warm: the page cache now holds the file
            t0 = time.perf_counter()
            r = fn()
            best = max(best, size / (time.perf_counter() - t0))
            del r
            torch.cuda.empty_cache()
        emit(name, "warm", best, 1.0, "best of 3")


if __name__ == "__main__":
    main()
