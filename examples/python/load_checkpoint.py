#!/usr/bin/env python3
"""Load a safetensors checkpoint (a file, a Hugging Face folder of shards or its index; local path or
ferry://host:port/path) straight into GPU memory with ferry.

    python3 examples/python/load_checkpoint.py model.safetensors --device cuda:0
    python3 examples/python/load_checkpoint.py ./Llama-3-8B/ --device cuda:0
    python3 examples/python/load_checkpoint.py ferry://10.0.0.5:7070/model.safetensors --rank 1 --world 4
    torchrun --nproc-per-node 4 examples/python/load_checkpoint.py ./Llama-3-8B/

With --world, each rank reads only its slice of every 2-D weight (rows, dim 0) and whole 1-D tensors. Under
torchrun (one process per GPU) the ranks of the node read the checkpoint once between them and hand each other
their slices over the GPUs' links (a torch.distributed group, NCCL on GPUs, gloo on the CPU).
"""
import argparse
import os
import time

import torch

import ferry
from ferry.safetensors import Shard


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--verify", action="store_true", help="check the checksums ferry.safetensors.save wrote")
    a = ap.parse_args()
    group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: rank, world and device from its environment
        import torch.distributed as dist
        a.rank, a.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if torch.cuda.is_available():
            a.device = f"cuda:{int(os.environ.get('LOCAL_RANK', a.rank))}"
            torch.cuda.set_device(a.device)
        dist.init_process_group("nccl" if a.device.startswith("cuda") else "gloo")
        group = dist.group.WORLD
    shard = None
    if a.world > 1:
        # Split 2-D weights by rows; keep everything else whole.
        with ferry.safetensors.safe_open(a.path, framework="pt") as f:
            dims = {k: 0 for k in f.keys() if len(f.get_slice(k).get_shape()) == 2}
        shard = Shard(a.rank, a.world, lambda name: dims.get(name))
    t0 = time.perf_counter()
    state = ferry.safetensors.load(a.path, device=a.device, shard=shard, group=group, verify=a.verify)
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    s = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"{len(state)} tensors, {nbytes / 2**30:.2f} GiB on {a.device} in {s:.2f} s ({nbytes / s / 1e9:.2f} GB/s)"
          + (f", rank {a.rank} of {a.world}" if a.world > 1 else ""))
    if group is not None:
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
