#!/usr/bin/env python3
"""A model larger than the GPU memory it may use: ferry's unified memory against accelerate's offload.

    python3 bench/python/offload.py --size 8GiB --rounds 2

The comparison (issue 55): a transformers Llama model (bf16, `--size` of weights, saved once with
save_pretrained) is run with the GPU memory it may use capped at half its size, two ways, each in a fresh process,
in alternating rounds:

  accelerate:  from_pretrained(folder, device_map="auto", max_memory={0: cap, "cpu": ...}): the layers past the cap
               stay in host memory and accelerate's hooks copy each one to the GPU when it runs
  ferry:       ferry.torch.use_unified_memory(cap) as torch's CUDA allocator, then
               ferry.transformers.from_pretrained(folder, device="cuda:0"): the tensors past the cap live in host
               memory of ferry's address space and the kernels read them there

Each process loads the model (timed), generates `--warmup` tokens (not timed), then `--tokens` tokens greedily
from a fixed prompt (timed: tokens/s). The generated tokens must be the same both ways in every round. Prints each
round, the medians and the target: ferry's tokens/s >= accelerate's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
way, path, cap, tokens, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
out = {}
if way == "ferry":
    import ferry.torch, ferry.transformers
    ferry.torch.use_unified_memory(cap)
torch.empty(1, device="cuda:0"); torch.cuda.synchronize()
t0 = time.perf_counter()
if way == "ferry":
    model = ferry.transformers.from_pretrained(path, device="cuda:0", dtype=torch.bfloat16)
else:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, device_map="auto", max_memory={0: cap, "cpu": 512 << 30}, dtype=torch.bfloat16)
torch.cuda.synchronize()
out["load_s"] = time.perf_counter() - t0
ids = (torch.arange(32, device="cuda:0").reshape(1, 32) * 7) % model.config.vocab_size
kw = dict(do_sample=False, pad_token_id=0)
with torch.no_grad():
    model.generate(ids, max_new_tokens=warmup, min_new_tokens=warmup, **kw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
    torch.cuda.synchronize()
    out["gen_s"] = time.perf_counter() - t0
out["tokens"] = got[0, ids.shape[1]:].tolist()
if way == "ferry":
    out["ferry"] = {k: v for k, v in ferry.torch.info().items() if isinstance(v, (int, float, str))}
    # torch keeps no statistics for a pluggable allocator: the GPU memory is what the space holds there
    # (never above its cap).
    out["gpu_bytes"] = out["ferry"]["resident_bytes"]
else:
    out["gpu_bytes"] = torch.cuda.max_memory_allocated()
print(json.dumps(out))
"""


def size_of(text: str) -> int:
    units = {"GIB": 1 << 30, "MIB": 1 << 20}
    t = text.strip().upper()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def make(path: str, size: int) -> None:
    import torch
    import transformers
    hidden, inter, vocab = 4096, 11008, 32000
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter)  # bf16 bytes of one decoder layer
    layers = max(1, round((size - 2 * 2 * vocab * hidden) / per_layer))
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=vocab,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="2GB")
    del model
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/ferry-offload")
    ap.add_argument("--size", default="8GiB", help="the model's weights (bf16)")
    ap.add_argument("--cap", help="GPU memory the model may use (default: half of --size)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ways", default="accelerate,ferry", help="which ways to run (a comma list)")
    a = ap.parse_args()
    unknown = set(a.ways.split(",")) - {"accelerate", "ferry"}
    if unknown:
        ap.error(f"--ways: unknown {', '.join(sorted(unknown))} (accelerate, ferry)")
    size = size_of(a.size)
    cap = size_of(a.cap) if a.cap else size // 2
    path = os.path.join(a.dir, a.size)
    if not os.path.exists(os.path.join(path, "config.json")):
        make(path, size)
    weights = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    print(f"# {path}: {weights / 2**30:.2f} GiB of weights, GPU cap {cap / 2**30:.2f} GiB "
          f"({weights / cap:.2f}x the cap); {a.tokens} tokens after {a.warmup}", flush=True)
    for f in os.listdir(path):  # warm page cache for both ways
        with open(os.path.join(path, f), "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass
    rows = {"accelerate": [], "ferry": []}
    same = True
    for r in range(a.rounds):
        got = {}
        for way in [w for w in (("accelerate", "ferry") if r % 2 == 0 else ("ferry", "accelerate")) if w in a.ways.split(",")]:
            p = subprocess.run([sys.executable, "-c", CHILD, way, path, str(cap), str(a.tokens), str(a.warmup)],
                               capture_output=True, text=True, timeout=900)
            if p.returncode != 0:
                # Python's fault handler lists every extension module on one line: not the news.
                err = "\n".join(x for x in p.stderr.splitlines() if not x.startswith("Extension modules:"))
                print(f"  round {r + 1} {way}: FAILED\n{err[-12000:]}", flush=True)
                return 1
            o = json.loads(p.stdout.strip().splitlines()[-1])
            got[way] = o
            rows[way].append(o)
            extra = f"  ferry: {o['ferry']}" if way == "ferry" else ""
            print(f"  round {r + 1} {way:<10} load {o['load_s']:6.2f} s  {a.tokens / o['gen_s']:7.2f} tokens/s  "
                  f"GPU memory {o['gpu_bytes'] / 2**30:.2f} GiB ({'resident at the end' if way == 'ferry' else 'peak allocated'}){extra}",
                  flush=True)
        if len(got) < 2:
            continue
        eq = got["accelerate"]["tokens"] == got["ferry"]["tokens"]
        same = same and eq
        print(f"  round {r + 1}: the same tokens both ways: {eq}", flush=True)
    if not all(rows.values()):
        return 0  # one way only: nothing to compare
    med = {w: statistics.median(a.tokens / o["gen_s"] for o in v) for w, v in rows.items()}
    load = {w: statistics.median(o["load_s"] for o in v) for w, v in rows.items()}
    print(f"# medians: accelerate {med['accelerate']:.2f} tokens/s (load {load['accelerate']:.2f} s), "
          f"ferry {med['ferry']:.2f} tokens/s (load {load['ferry']:.2f} s)")
    ratio = med["ferry"] / med["accelerate"]
    print(f"  ferry tokens/s / accelerate's: {ratio:.2f} (want >= 1.0) {'PASS' if ratio >= 1.0 else 'MISS'}")
    print(f"  the same tokens in every round: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
