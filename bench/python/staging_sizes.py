#!/usr/bin/env python3
"""A warm 4 GiB checkpoint into a GPU under settings: ferry.safetensors.load and one read of the whole file.

Each variant (a ';'-separated list of 'FERRY_X=v FERRY_Y=w' settings; the empty variant is the defaults) runs in a
fresh process that loads the checkpoint 4 times (the first load makes the staging pool), printing GB/s per load,
beside a pinned cudaMemcpy of the same size, and how busy each kind of thread was during the last load (cores, from
/proc's schedstat: the caller, ferry's io and transfer threads, the kernel's io_uring workers). Also per variant: one read of the file into pinned host memory (the
CPU's copy out of the page cache alone, no device copy: what bounds the staged path), and with --nginx the load
over http:// from nginx on loopback. The decision records docs/design/file-engine.md (staging size) and
docs/design/remote-sources.md (http threads) cite it.

    python3 bench/python/staging_sizes.py --variants ";FERRY_STAGING_BUFFERS=48 FERRY_STAGING_BYTES=8MiB FERRY_IO_CHUNK=8MiB"
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import os, sys, time, json, torch
torch.empty(1, device=sys.argv[2]); torch.cuda.synchronize()
import ferry
path, device = sys.argv[1], sys.argv[2]
def timed(fn):
    torch.cuda.synchronize(); t0 = time.perf_counter(); r = fn(); torch.cuda.synchronize(); return r, time.perf_counter() - t0
size = os.path.getsize(path)
f = ferry.open(path)
buf = torch.empty(size, dtype=torch.uint8, device=device)
host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
url = sys.argv[3] if len(sys.argv) > 3 else ""
rows = {"load": [], "one read of the file": [], "one read into pinned host memory": []}
if url:
    rows["load over http://"] = []
def gbps(s):
    return round(size / s / 1e9, 2)
def thread_ns():
    """Nanoseconds on a CPU per thread of this process (the kernel's io_uring workers are its threads too)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f1, open(f"/proc/self/task/{tid}/comm") as f2:
                out[tid] = (f2.read().strip(), int(f1.read().split()[0]))
        except OSError:
            pass
    return out
def cores_since(before, secs):
    """Cores busy per kind of thread (the name without its number) since `before`."""
    by = {}
    for tid, (name, ns) in thread_ns().items():
        if tid in before:
            kind = name.rstrip("0123456789").rstrip("-") or name
            by[kind] = by.get(kind, 0.0) + (ns - before[tid][1]) / 1e9 / secs
    return {k: round(v, 2) for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v >= 0.05}
for i in range(4):
    t0 = thread_ns()
    sd, s = timed(lambda: ferry.safetensors.load(path, device=device, progress=False)); rows["load"].append(gbps(s)); del sd
    rows["load's CPU, cores by thread (last load)"] = cores_since(t0, s)
    _, s = timed(lambda: f.read_into(buf)); rows["one read of the file"].append(gbps(s))
    _, s = timed(lambda: f.read_into(host)); rows["one read into pinned host memory"].append(gbps(s))
    if url:
        t0 = thread_ns()
        sd, s = timed(lambda: ferry.safetensors.load(url, device=device, progress=False)); rows["load over http://"].append(gbps(s)); del sd
        rows["http load's CPU, cores by thread (last load)"] = cores_since(t0, s)
print(json.dumps(rows))
'''

PINNED = r'''
import os, sys, time, torch
size = os.path.getsize(sys.argv[1])
p = torch.empty(size, dtype=torch.uint8, pin_memory=True); d = torch.empty(size, dtype=torch.uint8, device=sys.argv[2])
best = 0
for i in range(4):
    torch.cuda.synchronize(); t0 = time.perf_counter(); d.copy_(p, non_blocking=True); torch.cuda.synchronize()
    best = max(best, size / (time.perf_counter() - t0) / 1e9)
print(f"pinned cudaMemcpy, same size: {best:.2f} GB/s")
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--variants", default=";FERRY_STAGING_BUFFERS=16;FERRY_IO_CHUNK=8MiB FERRY_STAGING_BYTES=8MiB "
                    "FERRY_STAGING_BUFFERS=48;FERRY_IO_CHUNK=16MiB FERRY_STAGING_BYTES=16MiB")
    ap.add_argument("--nginx", default="", help="nginx, for a load over http:// per variant (default: none)")
    a = ap.parse_args()
    from load_checkpoint import make_checkpoint, find_nginx, start_nginx, stop_nginx

    path = os.path.join(a.dir, "ferry-bench-checkpoint.safetensors")
    info = make_checkpoint(path, 4 << 30, a.device)
    print(f"checkpoint {path}: {info['tensors']} tensors, {info['bytes']} bytes; warm (read once first)", flush=True)
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    print(subprocess.run([sys.executable, "-c", PINNED, path, a.device], capture_output=True, text=True).stdout.strip())
    fails = 0
    nginx = find_nginx(a.nginx) if a.nginx else ""
    web = start_nginx(nginx, a.dir) if nginx else None
    url = [f"http://127.0.0.1:{web[1]}/{os.path.basename(path)}"] if web else []
    try:
        for v in a.variants.split(";"):
            env = dict(os.environ)
            env.update(kv.split("=", 1) for kv in v.split())
            r = subprocess.run([sys.executable, "-c", CHILD, path, a.device] + url, capture_output=True, text=True, env=env)
            print(f"  {v or 'defaults':<66} {r.stdout.strip()}" + (f" FAILED: {r.stderr.strip()[-300:]}" if r.returncode else ""),
                  flush=True)
            fails += r.returncode != 0
    finally:
        if web:
            stop_nginx(web[0], web[2])
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
