"""Cooperative loads: the ranks of a process group (one process per rank: gloo with CPU tensors, and NCCL with
CUDA tensors where two GPUs are here) read every tensor once between them and end with exactly the slices a load
of their own would give; load_shards does the same for several devices of one process."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from ferry.safetensors import _owners, _waves
from st_files import write_numpy

RANK = r"""
import json, os, sys, torch, torch.distributed as dist
import ferry
from ferry.safetensors import Shard
import ferry.safetensors as st
path, rank, world, port, gpu, window = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1", int(sys.argv[6])
if window:
    st._COOP_WINDOW = window  # many waves, the two slots used in turn
device = f"cuda:{rank}" if gpu else "cpu"
if gpu:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
dims = {"embed": 0, "o_proj": 1, "down": -1, "odd": None}
rule = Shard(rank, world, lambda name: dims.get(name.split(".")[0], 0))
stats = {}
got = ferry.safetensors.load(path, device=device, shard=rule, group=dist.group.WORLD, progress=False, stats=stats)
own = ferry.safetensors.load(path, device=device, shard=rule, progress=False)
same = sorted(got) == sorted(own) and all(torch.equal(got[k], own[k]) and got[k].dtype == own[k].dtype for k in own)
try:
    ferry.safetensors.load(path, shard=Shard((rank + 1) % world, world, 0), group=dist.group.WORLD, progress=False)
    mismatch = "accepted"
except ferry.ArgumentError as e:
    mismatch = str(e)
print(json.dumps({"same": same, "bytes_read": stats["bytes_read"], "mismatch": mismatch}))
dist.destroy_process_group()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


@pytest.mark.parametrize("world,gpu,window", [(2, False, 0), (3, False, 0), (3, False, 512),
                                              (2, True, 0), (2, True, 512)])
def test_ranks_read_every_byte_once_and_get_their_slices(tmp_path, world, gpu, window):
    if gpu and _gpus() < world:
        pytest.skip(f"needs {world} GPUs (NCCL)")
    rng = np.random.default_rng(5)
    n = 6 * world
    arrays = {
        "embed.weight": rng.standard_normal((n * 8, 16)).astype(np.float32),
        "o_proj.weight": rng.standard_normal((10, n * 4)).astype(np.float16),
        "down.weight": rng.integers(-50, 50, (3, 5, n)).astype(np.int64),
        "odd.norm": rng.standard_normal(7).astype(np.float32),
        "odd.mask": rng.integers(0, 2, 13).astype(bool),
        "odd.scalar": np.array(2.5, dtype=np.float64),
        "odd.empty": np.zeros((0, 3), dtype=np.float32),
        "big.weight": rng.standard_normal((n * 64, 32)).astype(np.float32),
    }
    path = write_numpy(tmp_path / "m.safetensors", arrays)
    data_bytes = sum(a.nbytes for a in arrays.values())
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", RANK, path, str(r), str(world), port, str(int(gpu)), str(window)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["same"] for r in results), results
    assert sum(r["bytes_read"] for r in results) == data_bytes, "every byte read once on the node, none twice"
    assert all(r["bytes_read"] < data_bytes for r in results), "the reading is shared"
    assert all("does not match the group" in r["mismatch"] for r in results), results


def test_the_plan_gives_every_tensor_one_reader_and_balances_bytes():
    sizes = [100, 5, 70, 70, 1, 0, 30, 64]
    for world in (1, 2, 3, 4):
        owner = _owners(sizes, world)
        assert len(owner) == len(sizes) and all(0 <= o < world for o in owner)
        load = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(world)]
        assert max(load) - min(load) <= max(sizes), load
        assert owner == _owners(sizes, world), "the same on every rank"
    waves = _waves(sizes, 2, 60)
    assert [i for w in waves for i in w] == list(range(len(sizes))), "every tensor in one wave, in order"
    assert all(sum(sizes[i] for i in w) <= 120 or len(w) == 1 for w in waves)


def _arrays(world):
    rng = np.random.default_rng(7)
    n = 6 * world
    return {
        "embed.weight": rng.standard_normal((n * 8, 16)).astype(np.float32),
        "o_proj.weight": rng.standard_normal((10, n * 4)).astype(np.float16),
        "down.weight": rng.integers(-50, 50, (3, 5, n)).astype(np.int64),
        "odd.norm": rng.standard_normal(7).astype(np.float32),
        "odd.empty": np.zeros((0, 3), dtype=np.float32),
        "big.weight": rng.standard_normal((n * 64, 32)).astype(np.float32),
    }


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_process_gives_each_device_its_slices_reading_every_byte_once(tmp_path, world):
    import ferry
    from ferry.safetensors import Shard, load_shards

    arrays = _arrays(world)
    path = write_numpy(tmp_path / "m.safetensors", arrays)
    rule = {"embed.weight": 0, "o_proj.weight": 1, "down.weight": -1}
    dim = lambda name: rule.get(name)  # noqa: E731 - the rest whole
    stats = {}
    outs = load_shards(path, ["cpu"] * world, dim, progress=False, stats=stats)
    assert len(outs) == world
    for r, got in enumerate(outs):
        want = ferry.safetensors.load(path, "cpu", shard=Shard(r, world, dim), progress=False, mmap=False)
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            assert got[k].equal(want[k]), f"device {r}: {k}"
    assert stats["bytes_read"] == sum(a.nbytes for a in arrays.values()), "every byte read once, none twice"


def test_one_process_several_devices_refuses_bad_arguments(tmp_path):
    import ferry
    from ferry.safetensors import load_shards

    path = write_numpy(tmp_path / "m.safetensors", _arrays(2))
    for devices, what in ((["cpu"] * 0, "devices is empty"), ("cpu", "devices must be a list")):
        with pytest.raises(ferry.ArgumentError, match=what):
            load_shards(path, devices, progress=False)
    with pytest.raises(ferry.ArgumentError, match="'down.weight' dim 0 of size 3 does not split into 2"):
        load_shards(path, ["cpu", "cpu"], 0, progress=False)


def test_contiguous_slices_are_read_by_their_own_rank():
    from ferry.safetensors import _own_slice

    class E:
        def __init__(self, shape):
            self.shape = shape

    assert _own_slice(E((8, 4)), 0, 2), "dim 0: each rank's slice is one range of the file"
    assert _own_slice(E((1, 8)), 1, 2), "only a dim of size 1 before the split"
    assert not _own_slice(E((2, 8)), 1, 2), "rows: slices interleave, one reader and an exchange"
    assert not _own_slice(E((8, 4)), None, 2), "kept whole: one reader"


@pytest.mark.parametrize("world", [2, 3])
def test_many_small_waves_give_the_same_slices_and_stop_cleanly(tmp_path, monkeypatch, world):
    """Waves far smaller than the tensors: each wave's reads overlap the previous wave's exchange; every device
    still gets its slices, every byte is read once, and a consumer that stops early leaves nothing running."""
    import torch

    import ferry
    import ferry.safetensors as st
    from ferry.safetensors import Shard, load_shards

    monkeypatch.setattr(st, "_COOP_WINDOW", 256)
    arrays = _arrays(world)
    path = write_numpy(tmp_path / "m.safetensors", arrays)
    rule = {"embed.weight": 0, "o_proj.weight": 1, "down.weight": -1}
    dim = lambda name: rule.get(name)  # noqa: E731
    stats = {}
    outs = load_shards(path, ["cpu"] * world, dim, progress=False, stats=stats)
    for r, got in enumerate(outs):
        want = ferry.safetensors.load(path, "cpu", shard=Shard(r, world, dim), progress=False, mmap=False)
        assert all(got[k].equal(want[k]) for k in want), r
    assert stats["bytes_read"] == sum(a.nbytes for a in arrays.values())
    ck = st._Set(path, True)
    try:
        specs = st._shard_specs(torch, ck.pick(None), Shard(0, world, dim))
        outs = [{e.name: torch.empty(local, dtype=dt) for e, dt, _, local in specs} for _ in range(world)]
        gen = st._whole_reads(torch, specs, world, mine=lambda r: True, device_of=lambda r: torch.device("cpu"),
                              result_of=lambda r, i: outs[r][specs[i][0].name], timeout=10,
                              bar=st._Progress("t", False), label="t")
        assert len(st._waves([e.end - e.begin for e, *_ in specs], world, 256)) > 2
        cancelled = []
        real_cancel = ferry.Batch.cancel
        monkeypatch.setattr(ferry.Batch, "cancel", lambda b: (cancelled.append(b), real_cancel(b))[1])
        next(gen)
        assert not cancelled
        gen.close()  # the next wave's reads were sent: closing ends them instead of leaving them running
        assert cancelled, "the next wave's batches were cancelled and waited for"
    finally:
        ck.close()


@pytest.mark.parametrize("window", [0, 512])
def test_one_process_several_gpus_gets_the_slices(tmp_path, monkeypatch, window):
    """load_shards on CUDA devices: the exchange runs on the devices' streams while the next wave is read."""
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    import torch

    import ferry
    import ferry.safetensors as st
    from ferry.safetensors import Shard, load_shards

    if window:
        monkeypatch.setattr(st, "_COOP_WINDOW", window)
    arrays = _arrays(2)
    path = write_numpy(tmp_path / "m.safetensors", arrays)
    rule = {"embed.weight": 0, "o_proj.weight": 1, "down.weight": -1}
    dim = lambda name: rule.get(name)  # noqa: E731
    outs = load_shards(path, ["cuda:0", "cuda:1"], dim, progress=False)
    for r, got in enumerate(outs):
        want = ferry.safetensors.load(path, "cpu", shard=Shard(r, 2, dim), progress=False, mmap=False)
        assert all(got[k].device == torch.device(f"cuda:{r}") and got[k].cpu().equal(want[k]) for k in want), r
