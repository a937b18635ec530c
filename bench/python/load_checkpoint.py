#!/usr/bin/env python3
"""A checkpoint into GPU memory: ferry.safetensors.load next to safetensors, same file, same run.

A synthetic checkpoint shaped like an LLM's (transformer layers of bf16 weights, f32 norms, an f16 and an
int64 tensor per layer; --size bytes, >= 200 tensors) is written once. Then, cold (page cache dropped) and
warm, in turns: ferry.safetensors.load(path, device), safetensors.torch.load_file(path, device=...), and
safe_open(path, framework="pt", device=...) with get_tensor per tensor; the disk's ceiling (O_DIRECT reads
of the file by 16 threads, 8 MiB blocks); the same file through `ferry serve` on loopback (ferry://); and, where
nginx is installed, through nginx on loopback (http://) next to a download with urllib and safetensors.torch.load.
Every tensor of every ferry load is compared with safetensors' on the GPU. Prints the rows and the issue's
targets (warm >= 5x safetensors, cold >= 0.95x the ceiling and >= 1.2x safetensors, ferry:// >= 0.8x local warm,
warm >= 0.8x a pinned cudaMemcpy of the same size measured in the same run; http:// >= 0.8x local warm and >= 3x
the download).
"""
import argparse
import json
import mmap
import os
import re
import shutil
import socket
import subprocess
import tempfile
import sys
import threading
import time

import torch

import ferry

GiB = 1 << 30


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]i?B)?", s.strip())
    if not m:
        raise SystemExit(f"bad size {s!r}")
    return int(m.group(1)) * {None: 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)]


def make_checkpoint(path: str, size: int, device: str) -> dict:
    """Layers of (q, k, v, o: h x h bf16; gate, up: f x h bf16; down: h x f bf16; 2 norms f32 [h]; rope f16
    [512, 64]; positions int64 [4096]) until `size`, plus embed and lm_head."""
    h, f = 2048, 5632
    layer = 4 * h * h * 2 + 3 * f * h * 2 + 2 * h * 4 + 512 * 64 * 2 + 4096 * 8
    vocab = 32000
    layers = max(20, (size - 2 * vocab * h * 2) // layer)
    g = torch.Generator(device=device).manual_seed(1)
    t = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g, device=device).to(torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{n}.weight"] = torch.randn(h, h, generator=g, device=device).to(torch.bfloat16)
        t[p + "mlp.gate_proj.weight"] = torch.randn(f, h, generator=g, device=device).to(torch.bfloat16)
        t[p + "mlp.up_proj.weight"] = torch.randn(f, h, generator=g, device=device).to(torch.bfloat16)
        t[p + "mlp.down_proj.weight"] = torch.randn(h, f, generator=g, device=device).to(torch.bfloat16)
        t[p + "input_layernorm.weight"] = torch.rand(h, generator=g, device=device)
        t[p + "post_attention_layernorm.weight"] = torch.rand(h, generator=g, device=device)
        t[p + "rotary.cache"] = torch.randn(512, 64, generator=g, device=device).to(torch.float16)
        t[p + "positions"] = torch.arange(4096, device=device, dtype=torch.int64) * (i + 1)
    t["lm_head.weight"] = torch.randn(vocab, h, generator=g, device=device).to(torch.bfloat16)
    ferry.safetensors.save(t, path)
    return {"tensors": len(t), "bytes": os.path.getsize(path), "layers": layers}


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if os.geteuid() == 0:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def ceiling(path: str, threads: int = 16, block: int = 8 << 20) -> float:
    """GB/s of O_DIRECT reads of the whole file, `threads` threads taking the next block in turn."""
    size = os.path.getsize(path)
    nxt = [0]
    lock = threading.Lock()

    def work():
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, block)
        try:
            while True:
                with lock:
                    off = nxt[0]
                    nxt[0] += block
                if off >= size:
                    return
                os.preadv(fd, [buf], off)
        finally:
            os.close(fd)
            buf.close()

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return size / (time.perf_counter() - t0) / 1e9


def find_nginx(given: str = "") -> str:
    return next((n for n in (given, shutil.which("nginx"), "/usr/sbin/nginx") if n and os.path.exists(n)), "")


def start_nginx(nginx: str, root: str):
    """nginx on a free loopback port serving `root` (sendfile on, a worker per core, each with a listening socket
    of its own: `reuseport`, so that the kernel spreads a client's connections over all workers instead of the
    few that win the race for a shared socket); (process, port, its folder). Returns once the port accepts
    connections."""
    conf_dir = tempfile.mkdtemp(prefix="ferry-bench-nginx-")
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    temp = " ".join(f"{k}_temp_path {conf_dir}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    with open(os.path.join(conf_dir, "nginx.conf"), "w") as f:
        f.write(f"{'user root;' if os.geteuid() == 0 else ''} daemon off; worker_processes auto; pid {conf_dir}/pid; "
                f"error_log {conf_dir}/error.log; events {{ worker_connections 256; }} http {{ access_log off; {temp} "
                f"sendfile on; server {{ listen 127.0.0.1:{port} reuseport; root {root}; }} }}")
    srv = subprocess.Popen([nginx, "-c", os.path.join(conf_dir, "nginx.conf"), "-p", conf_dir],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return srv, port, conf_dir


def stop_nginx(srv, conf_dir: str) -> None:
    srv.terminate()
    srv.wait()
    shutil.rmtree(conf_dir, ignore_errors=True)


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ferry-binary", default=os.environ.get("FERRY_BINARY", ""), help="ferry, for the ferry:// row")
    ap.add_argument("--nginx", default="", help="nginx, for the http:// rows (default: the one on PATH, if any)")
    ap.add_argument("--json-out", default="")
    a = ap.parse_args()
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.path.join(a.dir, "ferry-bench-checkpoint.safetensors")
    t0 = time.perf_counter()
    info = make_checkpoint(path, parse_size(a.size), a.device)
    size = info["bytes"]
    print(f"checkpoint {path}: {size / GiB:.2f} GiB, {info['tensors']} tensors ({info['layers']} layers), "
          f"written in {time.perf_counter() - t0:.1f} s; device {a.device} ({torch.cuda.get_device_name(a.device)}); "
          f"torch {torch.__version__}, ferry {ferry.__version__}", flush=True)

    ref = load_file(path, device=a.device)  # the reference every ferry load is compared with

    def same(got) -> bool:
        return set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)

    def st_safe_open():
        out = {}
        with safe_open(path, framework="pt", device=a.device) as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
        return out

    ways = {
        "ferry.safetensors.load": lambda: ferry.safetensors.load(path, device=a.device, progress=False),
        "safetensors load_file": lambda: load_file(path, device=a.device),
        "safetensors safe_open+get_tensor": st_safe_open,
    }
    rows = []
    best = {}

    def row(what, kind, seconds, note=""):
        gbps = size / seconds / 1e9
        rows.append({"what": what, "kind": kind, "seconds": seconds, "gbps": gbps, "note": note})
        best[(what, kind)] = max(best.get((what, kind), 0), gbps)
        print(f"  {what:<40} {kind:<5} {seconds:7.2f} s {gbps:7.2f} GB/s  {note}", flush=True)

    all_ok = True
    for r in range(a.rounds):
        drop_cache(path)
        row("disk ceiling: O_DIRECT, 16 threads, 8 MiB", "cold", size / ceiling(path) / 1e9)
        for name, fn in ways.items():
            drop_cache(path)
            got, s = timed(fn)
            ok = same(got) if name.startswith("ferry") else True
            all_ok &= ok
            row(name, "cold", s, ("every tensor equal" if ok else "TENSORS DIFFER") if name.startswith("ferry") else "")
            del got
    # The copy engine's own rate in this run: one pinned host buffer of the checkpoint's size to the device,
    # in turns with the loads (a machine whose rate drifts moves both alike).
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev_buf = torch.empty(size, dtype=torch.uint8, device=a.device)
    for r in range(a.rounds):
        _, s = timed(lambda: dev_buf.copy_(pinned, non_blocking=True))
        row("pinned cudaMemcpy (torch copy_), same size", "warm", s)
        for name, fn in ways.items():
            got, s = timed(fn)
            ok = same(got) if name.startswith("ferry") else True
            all_ok &= ok
            row(name, "warm", s, ("every tensor equal" if ok else "TENSORS DIFFER") if name.startswith("ferry") else "")
            del got
    del pinned, dev_buf
    remote = 0.0
    if a.ferry_binary:
        srv = subprocess.Popen([a.ferry_binary, "serve", "--root", a.dir, "--listen", "127.0.0.1:0"],
                               stdout=subprocess.PIPE, text=True)
        try:
            port = re.search(r"127\.0\.0\.1:(\d+)", srv.stdout.readline()).group(1)
            uri = f"ferry://127.0.0.1:{port}/{os.path.basename(path)}"
            for r in range(a.rounds):
                got, s = timed(lambda: ferry.safetensors.load(uri, device=a.device, progress=False))
                ok = same(got)
                all_ok &= ok
                row("ferry.safetensors.load over ferry://", "warm", s, "every tensor equal" if ok else "TENSORS DIFFER")
                del got
        finally:
            srv.kill()
            srv.wait()
        remote = best[("ferry.safetensors.load over ferry://", "warm")]

    web = 0.0
    nginx = find_nginx(a.nginx)
    if nginx:
        import urllib.request

        from safetensors.torch import load as st_load

        # nginx on loopback serving the checkpoint's folder: ferry's ranges in parallel, against what a user of
        # requests does (download the file into memory, safetensors.torch.load, then each tensor to the device).
        srv, port, conf_dir = start_nginx(nginx, a.dir)
        try:
            url = f"http://127.0.0.1:{port}/{os.path.basename(path)}"

            def download_then_load():
                data = urllib.request.urlopen(url).read()
                return {k: v.to(a.device) for k, v in st_load(data).items()}

            for r in range(a.rounds):
                got, s = timed(lambda: ferry.safetensors.load(url, device=a.device, progress=False))
                ok = same(got)
                all_ok &= ok
                row("ferry.safetensors.load over http://", "warm", s, "every tensor equal" if ok else "TENSORS DIFFER")
                del got
                got, s = timed(download_then_load)
                row("urllib download + safetensors.torch.load", "warm", s)
                del got
        finally:
            stop_nginx(srv, conf_dir)
        web = best[("ferry.safetensors.load over http://", "warm")]

    def b(what, kind):
        return best.get((what, kind), 0)

    st_cold = max(b("safetensors load_file", "cold"), b("safetensors safe_open+get_tensor", "cold"))
    st_warm = max(b("safetensors load_file", "warm"), b("safetensors safe_open+get_tensor", "warm"))
    fc, fw = b("ferry.safetensors.load", "cold"), b("ferry.safetensors.load", "warm")
    targets = [
        ("warm ferry vs the faster safetensors way", fw / st_warm, 5.0),
        ("cold ferry vs the disk's ceiling (best of each)", fc / b("disk ceiling: O_DIRECT, 16 threads, 8 MiB", "cold"), 0.95),
        ("cold ferry vs the faster safetensors way", fc / st_cold, 1.2),
        ("warm ferry vs pinned cudaMemcpy of the same size", fw / b("pinned cudaMemcpy (torch copy_), same size", "warm"), 0.8),
    ]
    if remote:
        targets.append(("ferry:// warm vs local warm", remote / fw, 0.8))
    if web:
        targets.append(("http:// (nginx, loopback) warm vs local warm", web / fw, 0.8))
        targets.append(("http:// vs download + safetensors.torch.load", web / b("urllib download + safetensors.torch.load", "warm"), 3.0))
    print()
    for name, ratio, want in targets:
        print(f"target {name:<50} {ratio:5.2f}x (want >= {want:.2f}x): {'PASS' if ratio >= want else 'FAIL'}")
    print("every tensor of every ferry load equal to safetensors':", "yes" if all_ok else "NO")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"checkpoint": info, "rows": rows, "targets": [dict(zip(("target", "ratio", "want"), t)) for t in targets],
                       "all_equal": all_ok}, f, indent=2)
    os.unlink(path)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
