"""The examples in examples/python run as documented (on the CPU here; on a GPU where there is one)."""
import os
import subprocess
import sys

import torch

import ferry

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python")


def run(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, args[0]), *args[1:]], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_kv_cache_offload_and_restore(tmp_path):
    assert "verified" in run("kv_cache_offload.py", str(tmp_path / "kv.bin"), "--blocks", "64", "--block-kib", "64")


def test_load_checkpoint_whole_and_sharded(tmp_path):
    p = str(tmp_path / "m.safetensors")
    ferry.safetensors.save({"w": torch.randn(64, 16), "b": torch.randn(16), "e": torch.randn(32, 8)}, p)
    assert run("load_checkpoint.py", p, "--verify").startswith("3 tensors")
    assert run("load_checkpoint.py", p, "--rank", "1", "--world", "2").startswith("3 tensors")


def test_load_checkpoint_one_process_per_rank_as_torchrun_starts_them(tmp_path):
    """torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) set by hand: Debian's torchrun
    (torch 1.13 on Python 3.11) cannot start its workers."""
    import socket

    p = str(tmp_path / "m.safetensors")
    ferry.safetensors.save({"w": torch.randn(64, 16), "b": torch.randn(16), "e": torch.randn(32, 8)}, p)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen([sys.executable, os.path.join(EXAMPLES, "load_checkpoint.py"), p], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.startswith("3 tensors") and f"rank {rank} of 2" in out, out


def test_cp_between_paths(tmp_path):
    src = tmp_path / "a.bin"
    src.write_bytes(os.urandom((5 << 20) + 3))
    assert ferry.cp(str(src), str(tmp_path / "b.bin"), chunk=1 << 20) == (5 << 20) + 3
    assert (tmp_path / "b.bin").read_bytes() == src.read_bytes()
    # A copy that fails after making its destination leaves none behind (here: a timeout it cannot use).
    with __import__("pytest").raises(ferry.Error, match="timeout"):
        ferry.cp(src, tmp_path / "c.bin", timeout=-1)
    assert not (tmp_path / "c.bin").exists()


needs_cuda = __import__("pytest").mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_unified_memory_runs_a_workload_twice_its_cap(tmp_path):
    import json

    ref = json.loads(run("unified_memory.py", "--no-ferry", "--live", "512MiB", "--out", str(tmp_path / "ref.pt")))
    over = json.loads(run("unified_memory.py", "--cap", "256MiB", "--live", "512MiB", "--out", str(tmp_path / "over.pt")))
    under = json.loads(run("unified_memory.py", "--cap", "1GiB", "--live", "512MiB"))
    assert over["space"]["capacity"] == 256 << 20
    assert over["space"]["resident_bytes"] <= 256 << 20, over
    assert torch.equal(torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "over.pt")), (ref, over)
    assert over["digest"] == ref["digest"] == under["digest"]
    print(f"\nlive tensors 512 MiB: torch's allocator {ref['seconds']} s, ferry at 2x the cap {over['seconds']} s, "
          f"at 0.5x the cap {under['seconds']} s")


TORCH_BLOCKS = r"""
import json, torch, ferry.torch
ferry.torch.use_unified_memory(device_capacity="512MiB")
out = {}
a = torch.empty(1000, device="cuda")                  # a small block (4 KiB class)
pa = a.data_ptr()
del a
b = torch.empty(1000, device="cuda")
out["small_reused"] = b.data_ptr() == pa              # the same stream, the same class: the kept block
many = [torch.empty(256, device="cuda") for _ in range(100)]
ptrs = sorted(t.data_ptr() for t in many)
out["small_share_pages"] = ptrs[-1] - ptrs[0] < (2 << 20)  # 100 x 1 KiB in one 2 MiB page
del many
big = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
pbig = big.data_ptr()
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    other = torch.empty(16, device="cuda")           # torch allocates on the side stream too (attached from now)
    big.fill_(7)                                     # uses the block (on the GPU, a fill_ after a long kernel on
                                                     # its stream returned only once that kernel had ended)
    torch.cuda._sleep(2_000_000_000)                 # then the side stream is busy for about a second
del big                                              # freed on its own stream while the side stream may use it
out["side_busy_at_free"] = not side.query()          # else the check below proves nothing
out["fenced_after_free"] = ferry.torch.info()["fenced_bytes"]
again = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
out["fenced_while_busy"] = again.data_ptr() != pbig
torch.cuda.synchronize()
del again
third = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
fourth = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
out["kept_once_passed"] = pbig in (third.data_ptr(), fourth.data_ptr())
del third, fourth
info = ferry.torch.info()
out["kept_bytes"] = info["kept_bytes"]
out["released"] = ferry.torch.empty_cache()
out["kept_after"] = ferry.torch.info()["kept_bytes"]
print(json.dumps(out))
"""


@needs_cuda
def test_torch_tensors_on_unified_memory_reuse_blocks_per_stream(tmp_path):
    import json

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    p = subprocess.run([sys.executable, "-c", TORCH_BLOCKS], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["small_reused"] and out["small_share_pages"], out
    assert out["side_busy_at_free"], ("the side stream finished before the free: the test shows nothing", out)
    assert out["fenced_while_busy"] and out["fenced_after_free"] > 0, ("a block freed while another stream may use it was handed out again", out)
    assert out["kept_once_passed"], out
    assert out["kept_bytes"] > 0 and out["released"] > 0 and out["kept_after"] < out["kept_bytes"], out
