#!/usr/bin/env python3
"""Checkpoints as a new process meets them: ferry next to safetensors and transformers, one fresh process per load.

Every measured load runs in a process of its own that has made torch's CUDA context (and imported both libraries)
before the clock starts, as a torchrun rank or a serverless replica would; the page cache is warm. The ways
alternate, --rounds times:

  small:  a 64 MiB safetensors file to --device: ferry.safetensors.load vs safetensors.torch.load_file
  hf:     a transformers save_pretrained folder (>= 1 GiB, >= 3 shards) to a model on --device:
          from_pretrained(path, device_map=device, dtype=bf16) vs ferry.transformers.from_pretrained(path,
          device=device, dtype=bf16); the logits must equal from_pretrained's
  cpu:    the 64 MiB file and the hf folder's largest shard with device="cpu": ferry vs safetensors load_file

--phases prints where a fresh process's first ferry load spends its time (runtime, open, first read).
Prints each round and the medians with the issue's targets (small <= 1.2x safetensors' time, hf >= 1.5x faster
than from_pretrained, cpu >= 1.0x safetensors).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
import torch
what, path, device = sys.argv[1], sys.argv[2], sys.argv[3]
if device.startswith("cuda"):
    torch.empty(1, device=device); torch.cuda.synchronize()
import ferry, safetensors.torch
out = {}
def sync():
    if device.startswith("cuda"):
        torch.cuda.synchronize()
if what == "phases":
    t0 = time.perf_counter(); rt = ferry.runtime(); out["runtime"] = time.perf_counter() - t0
    t0 = time.perf_counter(); f = ferry.open(path); out["open"] = time.perf_counter() - t0
    t = torch.empty(4096, dtype=torch.uint8, device=device)
    t0 = time.perf_counter(); f.read_into(t); sync(); out["first 4 KiB read"] = time.perf_counter() - t0
    t = torch.empty(f.size, dtype=torch.uint8, device=device)
    t0 = time.perf_counter(); f.read_into(t); sync(); out["then the whole file"] = time.perf_counter() - t0
    t0 = time.perf_counter(); f.read_into(t); sync(); out["the whole file again"] = time.perf_counter() - t0
    t0 = time.perf_counter(); ferry.safetensors.load(path, device=device, progress=False); sync()
    out["then ferry.safetensors.load"] = time.perf_counter() - t0
elif what in ("ferry", "safetensors"):
    t0 = time.perf_counter()
    sd = ferry.safetensors.load(path, device=device, progress=False) if what == "ferry" else safetensors.torch.load_file(path, device=device)
    sync()
    out["seconds"] = time.perf_counter() - t0
    out["bytes"] = sum(t.numel() * t.element_size() for t in sd.values())
else:  # hf-*: a model from a save_pretrained folder
    import transformers
    from transformers import LlamaForCausalLM  # transformers imports a model's module on first use: not timed
    t0 = time.perf_counter()
    if what == "hf-ferry":
        model = ferry.transformers.from_pretrained(path, device=device, dtype=torch.bfloat16)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map=device, dtype=torch.bfloat16)
    sync()
    out["seconds"] = time.perf_counter() - t0
    ids = torch.arange(64, device=device).reshape(1, 64) * 7 % model.config.vocab_size
    with torch.no_grad():
        logits = model(ids).logits.float().cpu()
    torch.save(logits, sys.argv[4])
print(json.dumps(out))
"""


def child(*args, env=None, fatal=True):
    r = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=600,
                       env={**os.environ, **(env or {})})
    if r.returncode != 0:
        if fatal:
            raise SystemExit(f"child {args} failed:\n{r.stdout}\n{r.stderr}")
        print(f"  {args[0]} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}", flush=True)
        return None
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if (env or {}).get("FERRY_LOG") == "debug":  # what the runtime says it paid for each part
        for line in r.stderr.splitlines():
            if "made in" in line or "opened in" in line or "buffers (" in line:
                print(f"    {line}")
    return out


def make_small(path, nbytes=64 << 20):
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(3)
    t, left, i = {}, nbytes, 0
    while left > 0:
        n = min(left // 2, 1 << 20 if i % 3 else 4 << 20)
        t[f"layer.{i}.weight"] = torch.randn(n, generator=g).to(torch.bfloat16)
        left -= 2 * n
        i += 1
    save_file(t, path, metadata={"format": "pt"})


def make_hf(path, layers):
    import torch
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                                   num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda:0" if torch.cuda.is_available() else "cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="400MB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/ferry-fresh")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=10, help="hf model layers (10: 1.3 GB in bf16)")
    ap.add_argument("--only", default="phases,small,hf,cpu")
    a = ap.parse_args()
    only = set(a.only.split(","))
    os.makedirs(a.dir, exist_ok=True)
    small = os.path.join(a.dir, "small.safetensors")
    hf = os.path.join(a.dir, "hf")
    if not os.path.exists(small):
        make_small(small)
    if "hf" in only and not os.path.exists(os.path.join(hf, "config.json")):
        make_hf(hf, a.layers)
    results = {}

    def row(key, got):
        results.setdefault(key, []).append(got["seconds"])
        print(f"  {key:<34} {got['seconds'] * 1e3:9.1f} ms", flush=True)

    if "phases" in only:
        print("# where a fresh process's first ferry load goes (64 MiB file, warm)")
        for env in ({}, {"FERRY_FILE_BACKEND": "io_uring"}, {"FERRY_LOG": "debug"}):
            print(f"  {env or 'defaults'}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in child("phases", small, a.device, env=env).items()))
    for r in range(a.rounds):
        print(f"# round {r + 1}", flush=True)
        if "small" in only:
            for way in ("ferry", "safetensors"):
                row(f"small {way}", child(way, small, a.device))
        if "cpu" in only:
            shard = max((os.path.join(hf, f) for f in os.listdir(hf) if f.endswith(".safetensors")), key=os.path.getsize) \
                if os.path.isdir(hf) else small
            for name, p in (("small", small), ("hf shard", shard)):
                for way in ("ferry", "safetensors"):
                    row(f"cpu {name} {way}", child(way, p, "cpu"))
        if "hf" in only:
            import torch
            for way in ("hf-from_pretrained", "hf-ferry"):
                logits = os.path.join(a.dir, f"logits-{way}.pt")
                got = child(way, hf, a.device, logits, fatal=way == "hf-from_pretrained")
                if got is None:
                    continue
                row(way, got)
                if way != "hf-from_pretrained":
                    same = torch.equal(torch.load(logits), torch.load(os.path.join(a.dir, "logits-hf-from_pretrained.pt")))
                    print(f"  {way}: logits equal to from_pretrained's: {same}")
                    results.setdefault(f"{way} logits equal", []).append(same)
    print("# medians")
    med = {k: statistics.median(v) for k, v in results.items() if "logits" not in k}
    for k, v in med.items():
        print(f"  {k:<34} {v * 1e3:9.1f} ms")
    checks = []
    if "small" in only:
        checks.append(("small: ferry time <= 1.2x safetensors'", med["small ferry"] / med["small safetensors"], "<=", 1.2))
    if "hf" in only:
        for way in ("hf-ferry",):
            if way in med:
                checks.append((f"{way}: from_pretrained time / this way's >= 1.5", med["hf-from_pretrained"] / med[way], ">=", 1.5))
                checks.append((f"{way}: logits equal in every round", float(all(results[f"{way} logits equal"])), ">=", 1.0))
    if "cpu" in only:
        for name in ("small", "hf shard"):
            checks.append((f"cpu {name}: safetensors time / ferry's >= 1.0",
                           med[f"cpu {name} safetensors"] / med[f"cpu {name} ferry"], ">=", 1.0))
    print("# targets")
    for what, v, op, target in checks:
        ok = v <= target if op == "<=" else v >= target
        print(f"  {what}: {v:.2f} {'PASS' if ok else 'MISS'}")


if __name__ == "__main__":
    main()
