"""The Python package as a user calls it: numpy arrays, torch tensors (CPU here; CUDA where a GPU is),
files changing underneath, ferry:// served by a `ferry serve` process, and bad input."""
import gc
import json
import os
import re
import select
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import ferry
import procs
from ferry.safetensors import Shard
from st_files import write_numpy

rng = np.random.default_rng(7)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def random_file(path, nbytes):
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    data.tofile(path)
    return data


def test_version_and_settings():
    assert re.match(r"\d+\.\d+\.\d+", ferry.__version__)
    s = ferry.settings()
    assert "FERRY_DEADLINE" in s and "FERRY_IO_CHUNK" in s


def test_numpy_and_torch_round_trips(tmp_path):
    p = str(tmp_path / "data.bin")
    want = random_file(p, (3 << 20) + 4321)
    with ferry.open(p) as f:
        assert f.size == want.size
        got = np.empty_like(want)
        assert f.read_into(got) == want.size
        np.testing.assert_array_equal(got, want)
        t = torch.empty(1000, dtype=torch.float32)  # 4000 bytes from an unaligned offset
        assert f.read_into(t, 777) == 4000
        assert t.numpy().tobytes() == want[777:4777].tobytes()
        tail = bytearray(100)
        assert f.read_into(tail, want.size - 10) == 10, "a read past the end is short"
    q = str(tmp_path / "out.bin")
    src = torch.from_numpy(rng.standard_normal(1 << 18).astype(np.float32))
    with ferry.open(q, "w") as f:
        f.write_from(src, 0)
        f.write_from(b"tail", src.numel() * 4, sync=True)
    back = np.fromfile(q, dtype=np.uint8)
    assert back[: src.numel() * 4].tobytes() == src.numpy().tobytes()
    assert back[-4:].tobytes() == b"tail"


def test_sim_device_memory(tmp_path):
    p = str(tmp_path / "sim.bin")
    want = random_file(p, 5 << 20)
    dev = ferry.empty(want.size, "sim:0")
    with ferry.open(p) as f:
        assert f.read_into(dev) == want.size  # file -> sim device memory
    back = np.zeros_like(want)
    ferry.copy(back, dev)
    np.testing.assert_array_equal(back, want)
    host = rng.integers(0, 256, want.size, dtype=np.uint8)
    ferry.copy(dev, host)
    assert ferry.safetensors.checksum(torch.from_numpy(host)) == ferry.runtime().checksum(dev.ptr, dev.nbytes)


def test_pinned_memory_is_a_tensor_without_a_copy(tmp_path):
    p = str(tmp_path / "pinned.bin")
    want = random_file(p, 3 << 20)
    buf = ferry.empty(want.size)  # pinned host memory
    with ferry.open(p) as f:
        assert f.read_into(buf) == want.size
    t = ferry.as_tensor(buf)
    assert t.data_ptr() == buf.ptr and t.numel() == want.size
    np.testing.assert_array_equal(t.numpy(), want)
    floats = ferry.as_tensor(buf, torch.float32, (-1, 1024))
    assert floats.shape == (768, 1024) and floats.data_ptr() == buf.ptr
    with pytest.raises(BufferError, match="sim:0"):
        ferry.as_tensor(ferry.empty(4096, "sim:0"))


def test_ferry_memory_is_exported_with_dlpack(tmp_path):
    p = str(tmp_path / "dlpack.bin")
    want = random_file(p, 1 << 20)
    buf = ferry.empty(want.size)
    with ferry.open(p) as f:
        assert f.read_into(buf) == want.size
    assert buf.__dlpack_device__() == (1, 0)  # kDLCPU: pinned host memory is CPU memory to every consumer
    refs = sys.getrefcount(buf)
    t = torch.from_dlpack(buf)
    a = np.from_dlpack(buf)
    assert t.data_ptr() == buf.ptr and a.ctypes.data == buf.ptr and t.numel() == a.size == want.size
    assert sys.getrefcount(buf) == refs + 2, "each array holds the buffer"
    np.testing.assert_array_equal(a, want)
    t[7] = (int(want[7]) + 1) % 256
    assert a[7] == t[7], "one memory, no copies"
    del a
    gc.collect()
    assert sys.getrefcount(buf) == refs + 1
    # The tensor alone keeps the memory: with the buffer object gone, it still reads the file's bytes.
    del buf
    gc.collect()
    np.testing.assert_array_equal(t[8:].numpy(), want[8:])
    # A capsule nobody consumed lets go of the buffer when it is dropped.
    other = ferry.empty(4096)
    refs = sys.getrefcount(other)
    capsule = other.__dlpack__()
    assert sys.getrefcount(other) == refs + 1
    del capsule
    gc.collect()
    assert sys.getrefcount(other) == refs
    with pytest.raises(BufferError, match="copy=True"):
        other.__dlpack__(copy=True)
    with pytest.raises(BufferError, match=r"not \(2, 0\)"):
        other.__dlpack__(dl_device=(2, 0))


class OnlyDLPack:
    """An array known to ferry only through DLPack (as a JAX array is)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__()

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def test_dlpack_arrays_are_buffers(tmp_path):
    p = str(tmp_path / "dl.bin")
    want = random_file(p, 1 << 20)
    t = torch.zeros(want.size // 4, dtype=torch.int32)
    with ferry.open(p) as f:
        assert f.read_into(OnlyDLPack(t)) == want.size
        assert f.read_into(OnlyDLPack(t[10:20]), 40) == 40, "a slice: its own offset and size"
    assert t.numpy().tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="not C-contiguous"):
        ferry.copy(OnlyDLPack(torch.zeros(8, 8).t()), np.zeros(256, dtype=np.uint8))


def test_a_batch_of_reads_and_its_results(tmp_path):
    p = str(tmp_path / "batch.bin")
    want = random_file(p, 8 << 20)
    f = ferry.open(p)
    offsets = rng.integers(0, want.size - 65536, 64)
    bufs = [np.empty(65536, dtype=np.uint8) for _ in offsets]
    with ferry.read_batch([(f, int(o), b) for o, b in zip(offsets, bufs)]) as batch:
        assert batch.wait(float("inf"))  # a timeout past any deadline: until it is over, as without one
        assert batch.wait(0) and batch.wait()
        assert batch.bytes_done == batch.bytes_total == 64 * 65536
        assert all(r["state"] == "done" for r in batch.results())
    for o, b in zip(offsets, bufs):
        np.testing.assert_array_equal(b, want[o:o + 65536])
    with pytest.raises(ferry.Error, match="timeout"):
        ferry.read_batch([(f, 0, bufs[0])]).wait(-1)
    # A request into a buffer that is too small for nbytes is refused before anything runs.
    with pytest.raises(ValueError, match="outside the buffer"):
        ferry.read_batch([(f, 0, bufs[0], 1 << 20)])
    # Offsets: ints >= 0, numpy's included; anything else is refused naming the request, before anything runs.
    for bad in (-5, 1 << 64, 1.5, "0", None):
        with pytest.raises(ferry.ArgumentError, match=r"read_batch request 1: offset .* is not a byte offset") as e:
            ferry.read_batch([(f, 0, bufs[0]), (f, bad, bufs[1])])
        assert e.value.code == "invalid_argument"
    with pytest.raises(ValueError, match="not a byte count"):
        ferry.read_batch([(f, 0, bufs[0], 100.0)])
    with ferry.read_batch([(f, np.int64(65536), bufs[0]), (f, np.uint32(7), bufs[1], np.int64(100))]) as batch:
        batch.check()
        assert [r["bytes_done"] for r in batch.results()] == [65536, 100]
    np.testing.assert_array_equal(bufs[0], want[65536:131072])
    np.testing.assert_array_equal(bufs[1][:100], want[7:107])


def test_bad_input_is_an_exception_with_ferrys_message(tmp_path):
    missing = str(tmp_path / "nope.bin")
    with pytest.raises(ferry.Error) as e:
        ferry.open(missing)
    assert e.value.code == "not_found" and missing in str(e.value)
    with pytest.raises(ferry.Error) as e:
        ferry.open(missing, "x")
    assert e.value.code == "invalid_argument" and "mode" in str(e.value)
    p = str(tmp_path / "small.bin")
    random_file(p, 4096)
    f = ferry.open(p)
    with pytest.raises(ValueError, match="writable"):
        f.read_into(b"read-only bytes")
    with pytest.raises(ValueError, match="not contiguous"):
        f.read_into(torch.empty(64, 64)[:, ::2])
    with pytest.raises(TypeError, match="not a buffer ferry can use"):
        f.read_into(object())
    with pytest.raises(ferry.Error) as e:
        f.write_from(b"x")
    assert e.value.code == "permission_denied"
    with pytest.raises(ferry.Error) as e:
        ferry.empty(1 << 20, "sim:7")
    assert "sim:7" in str(e.value)


def test_a_closed_batch_refuses_use_and_cp_refuses_one_file(tmp_path):
    p = str(tmp_path / "c.bin")
    random_file(p, 1 << 20)
    f = ferry.open(p)
    buf = np.empty(1 << 20, dtype=np.uint8)
    with f.read_async(buf) as b:
        b.check()
    with pytest.raises(ferry.Error, match="closed"):
        b.results()
    with pytest.raises(ValueError, match="both the source and the destination"):
        ferry.cp(p, p)
    grow = bytearray(4096)
    with ferry.read_batch([(f, 0, grow)]) as b:
        with pytest.raises(BufferError):
            grow.extend(b"x")  # ferry is using it: not resized under the read
        b.check()


def test_a_cut_short_checkpoint_is_an_error(tmp_path):
    p = str(tmp_path / "cut.safetensors")
    ferry.safetensors.save({"a": torch.randn(1000), "b": torch.randn(1000)}, p)
    os.truncate(p, os.path.getsize(p) - 100)
    with pytest.raises(ValueError, match="cut short"):
        ferry.safetensors.load(p, progress=False)


def test_a_file_cut_short_under_a_read_says_so(tmp_path):
    p = str(tmp_path / "shrinks.bin")
    random_file(p, 64 << 20)
    f = ferry.open(p)
    os.truncate(p, 1 << 20)
    buf = np.empty(64 << 20, dtype=np.uint8)
    assert f.read_into(buf) == 1 << 20, "the bytes that exist, no more"


def checkpoint():
    return {
        "embed": rng.standard_normal((512, 96)).astype(np.float32),
        "norm": rng.standard_normal(96).astype(np.float16),
        "ids": rng.integers(-9, 9, (7, 3)).astype(np.int64),
        "mask": rng.integers(0, 2, 33).astype(bool),
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "w": rng.standard_normal((64, 48)).astype(np.float32),
    }


def test_a_safetensors_file_made_with_numpy_loads_exactly(tmp_path):
    p = str(tmp_path / "np.safetensors")
    arrays = checkpoint()
    write_numpy(p, arrays, {"made": "numpy"})
    got = ferry.safetensors.load(p, progress=False)
    assert set(got) == set(arrays)
    for k, a in arrays.items():
        assert tuple(got[k].shape) == a.shape
        np.testing.assert_array_equal(got[k].numpy(), a)
    some = ferry.safetensors.load(p, names=["w", "norm"], progress=False)
    assert set(some) == {"w", "norm"}
    with pytest.raises(ferry.ArgumentError, match="nothere"):
        ferry.safetensors.load(p, names=["nothere"], progress=False)


def test_save_load_verify_and_shards(tmp_path):
    p = str(tmp_path / "torch.safetensors")
    tensors = {k: torch.from_numpy(v) for k, v in checkpoint().items()}
    tensors["bf16"] = torch.randn(16, 8).to(torch.bfloat16)
    ferry.safetensors.save(tensors, p, {"note": "ferry"})
    got = ferry.safetensors.load(p, verify=True, progress=False)
    for k, t in tensors.items():
        assert torch.equal(got[k], t), k
    # Two ranks, each its half of "embed" along dim 0 and of "w" along dim 1; the rest whole.
    dims = {"embed": 0, "w": 1}
    for rank in range(2):
        part = ferry.safetensors.load(p, names=["embed", "w", "norm"], shard=Shard(rank, 2, lambda n: dims.get(n)),
                                      progress=False)
        assert torch.equal(part["embed"], tensors["embed"][rank * 256:(rank + 1) * 256])
        assert torch.equal(part["w"], tensors["w"][:, rank * 24:(rank + 1) * 24])
        assert torch.equal(part["norm"], tensors["norm"])
    with pytest.raises(ValueError, match="does not split"):
        ferry.safetensors.load(p, names=["ids"], shard=Shard(0, 2, 1), progress=False)
    # A corrupted byte is caught by verify.
    with open(p, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(ValueError, match="checksum"):
        ferry.safetensors.load(p, verify=True, progress=False)


class _Served(tuple):
    """(root, ferry:// prefix), and the server's pid."""
    pid = 0


def _serve(tmp_path, env=None):
    """`ferry serve` over tmp_path/root as a process of its own (with `env` added to its environment); yields
    (root, its ferry:// prefix)."""
    binary = os.environ.get("FERRY_BINARY")
    if not binary:
        pytest.skip("FERRY_BINARY (the ferry program) not given")
    root = tmp_path / "root"
    root.mkdir()
    proc = subprocess.Popen([binary, "serve", "--root", str(root), "--listen", "127.0.0.1:0", "--writable", "--insecure"],
                            stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env={**os.environ, **(env or {})})
    try:
        line = proc.stdout.readline()
        m = re.search(r"127\.0\.0\.1:(\d+)", line)
        assert m, f"ferry serve said: {line!r}"
        out = _Served((root, f"ferry://127.0.0.1:{m.group(1)}"))
        out.pid = proc.pid
        yield out
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def served(tmp_path):
    """A same-host server as started by default: it lends files on a local file system to the clients that read
    them."""
    yield from _serve(tmp_path)


@pytest.fixture
def served_through(tmp_path):
    """The same, every read going through the server (FERRY_SERVE_LEND_FILES=0): the road of another host."""
    yield from _serve(tmp_path, {"FERRY_SERVE_LEND_FILES": "0"})


def test_a_same_host_server_lends_files_that_are_then_read_from_the_file_itself(served):
    """A same-host server (by default) passes the client a read-only descriptor of each file on a local file system
    opened for reading: reads and checkpoint loads are exact, and go on once the file is open even with the server
    gone (they no longer go through it); writes still go through the server."""
    root, uri = served
    want = random_file(root / "blob.bin", (3 << 20) + 77)
    tensors = {k: torch.from_numpy(v) for k, v in checkpoint().items()}
    ferry.safetensors.save(tensors, f"{uri}/ckpt.safetensors")
    got = ferry.safetensors.load(f"{uri}/ckpt.safetensors", verify=True, progress=False)
    for k, t in tensors.items():
        assert torch.equal(got[k], t), k
    f = ferry.open(f"{uri}/blob.bin")
    os.kill(served.pid, signal.SIGKILL)
    for _ in range(200):  # dead (a zombie until the fixture reaps it)
        with open(f"/proc/{served.pid}/stat") as st:
            if st.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        select.select([], [], [], 0.01)
    b = np.empty_like(want)
    assert f.read_into(b) == want.size
    np.testing.assert_array_equal(b, want)
    part = np.empty(4097, dtype=np.uint8)
    assert f.read_into(part, offset=12345) == part.size
    np.testing.assert_array_equal(part, want[12345:12345 + part.size])


@pytest.mark.parametrize("road", ["served", "served_through"], ids=["lent", "through-the-server"])
def test_ferry_uri_read_write_and_checkpoint(road, request):
    root, uri = request.getfixturevalue(road)
    want = random_file(root / "blob.bin", (2 << 20) + 99)
    with ferry.open(f"{uri}/blob.bin") as f:
        got = np.empty_like(want)
        assert f.read_into(got) == want.size
    np.testing.assert_array_equal(got, want)
    # ferry.cp: server -> local -> server
    local = root.parent / "local.bin"
    assert ferry.cp(f"{uri}/blob.bin", str(local), chunk=1 << 20) == want.size
    assert ferry.cp(str(local), f"{uri}/blob2.bin") == want.size
    np.testing.assert_array_equal(np.fromfile(root / "blob2.bin", dtype=np.uint8), want)
    tensors = {k: torch.from_numpy(v) for k, v in checkpoint().items()}
    ferry.safetensors.save(tensors, f"{uri}/ckpt.safetensors")
    assert (root / "ckpt.safetensors").exists(), "committed on the server when save returned"
    got = ferry.safetensors.load(f"{uri}/ckpt.safetensors", verify=True, progress=False)
    for k, t in tensors.items():
        assert torch.equal(got[k], t), k


FORKED = r"""
import json, os, sys, time, numpy as np, ferry
local, remote, parent_remote = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
want = np.fromfile(local, dtype=np.uint8)
got = np.zeros_like(want); ferry.open(local).read_into(got)  # the parent's runtime and its threads exist
inherited = ferry.open(remote) if parent_remote else None
old = ferry.runtime()
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # a data loader's worker: ends the way a Python program does (no os._exit)
    os.close(r)
    out, t0 = {}, time.monotonic()
    b = np.zeros_like(want); ferry.open(local).read_into(b); out["local"] = bool((b == want).all())
    calls = [("remote", lambda: ferry.open(remote).read_into(b)), ("old_runtime", lambda: old.open(local, "r"))]
    if inherited:
        calls.append(("inherited", lambda: inherited.read_into(np.zeros(16, dtype=np.uint8))))
    for name, call in calls:
        try:
            b[:] = 0; call(); out[name] = bool((b == want).all()) if name == "remote" else "worked"
        except ferry.Error as e:
            out[name] = str(e)
    out["seconds"] = time.monotonic() - t0
    os.write(w, json.dumps(out).encode()); os.close(w)
    sys.exit(0)
os.close(w)
child = json.loads(os.read(r, 1 << 16).decode())
_, status = os.waitpid(pid, 0)
child["status"] = status
b = np.zeros_like(want); ferry.open(remote).read_into(b); child["parent_after"] = bool((b == want).all())
print(json.dumps(child))
"""


@pytest.mark.parametrize("road", ["served", "served_through"], ids=["lent", "through-the-server"])
@pytest.mark.parametrize("parent_remote", [False, True], ids=["parent-local", "parent-remote"])
def test_a_forked_child_gets_a_runtime_of_its_own(road, parent_remote, request):
    """A process forked after ferry was used (a data loader's workers): ferry.runtime() makes it a runtime of its
    own and local files read right. ferry:// works there when the parent had no ferry:// connection at the fork;
    otherwise (UCX does not survive fork) it fails at once saying so, as does a remote file the parent opened;
    the parent's runtime says what to use instead. A file the server lent the parent is the file itself: the
    child reads it on, as it does a local file. Nothing waits for threads that stayed behind; the child ends
    normally and the parent reads on."""
    root, uri = request.getfixturevalue(road)
    random_file(root / "f.bin", (1 << 20) + 77)
    p = subprocess.run([sys.executable, "-c", FORKED, str(root / "f.bin"), f"{uri}/f.bin", str(int(parent_remote))],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["local"] and got["parent_after"] and got["status"] == 0 and got["seconds"] < 5, got
    assert "was forked from the one that made it" in got["old_runtime"], got
    if parent_remote:
        if road == "served":
            assert got["inherited"] == "worked", got
        else:
            assert "which this one was forked from" in got["inherited"] and "open the file again here" in got["inherited"], got
        assert "does not survive fork" in got["remote"], got
    else:
        assert got["remote"] is True, got


FORKED_UNDER_MUNMAP = r"""
import json, mmap, os, select, sys, threading, numpy as np, ferry
local, remote, forks = sys.argv[1], sys.argv[2], int(sys.argv[3])
want = np.fromfile(local, dtype=np.uint8)
ferry.open(local).read_into(np.zeros_like(want))  # the parent's runtime: its memory hooks are installed
stop = False
def churn():  # another thread of the parent maps and unmaps all the time (a loader's allocator)
    while not stop:
        mmap.mmap(-1, 1 << 16).close()
threading.Thread(target=churn, daemon=True).start()
out = {"forks": forks, "hung": [], "wrong": []}
for i in range(forks):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        b = np.zeros_like(want)
        try:
            ferry.open(remote).read_into(b); got = bool((b == want).all())
        except ferry.Error as e:
            got = str(e)
        os.write(w, json.dumps(got).encode()); os._exit(0)
    os.close(w)
    if select.select([r], [], [], 20)[0]:
        got = json.loads(os.read(r, 1 << 16).decode())
        if got is not True:
            out["wrong"].append([i, got])
    else:
        out["hung"].append(i); os.kill(pid, 9)
    os.close(r); os.waitpid(pid, 0)
stop = True
print(json.dumps(out))
"""


def test_children_forked_while_the_parent_unmaps_memory_read_ferry_uris(served):
    """Children forked while another thread of the parent unmaps memory (UCX's memory hooks are inside
    their lock then, and the child inherits it held) each read a ferry:// file, every one, none waiting
    forever (before: about one child in five hung in UCX's start)."""
    root, uri = served
    random_file(root / "f.bin", (1 << 20) + 77)
    p = subprocess.run([sys.executable, "-c", FORKED_UNDER_MUNMAP, str(root / "f.bin"), f"{uri}/f.bin", "40"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["hung"] == [] and got["wrong"] == [], got


def test_ctrl_c_ends_a_read_from_a_stopped_server_at_once(served_through):
    """The user's Ctrl-C during a ferry:// read of a server that stopped answering (SIGSTOP):
    KeyboardInterrupt now, not at the deadline (30 s)."""
    served = served_through
    root, uri = served
    random_file(root / "big.bin", 32 << 20)
    code = ("import json, os, signal, sys, numpy as np, ferry\n"
            f"f = ferry.open({uri + '/big.bin'!r}); b = np.zeros(f.size, dtype=np.uint8)\n"
            "print('ready', flush=True); sys.stdin.readline()\n"
            "try:\n    f.read_into(b); print(json.dumps({'interrupted': False}))\n"
            "except KeyboardInterrupt:\n    print(json.dumps({'interrupted': True}))\n")
    try:
        got = procs.ctrl_c(code, after=1.0, on_ready=lambda: os.kill(served.pid, signal.SIGSTOP))
    finally:
        os.kill(served.pid, signal.SIGCONT)
    assert got["interrupted"] and got["after_signal"] < 5, got


@cuda
def test_cuda_tensors_and_a_users_stream(tmp_path):
    p = str(tmp_path / "gpu.bin")
    want = random_file(p, 64 << 20)
    f = ferry.open(p)
    t = torch.empty(want.size, dtype=torch.uint8, device="cuda:0")
    assert f.read_into(t) == want.size
    np.testing.assert_array_equal(t.cpu().numpy(), want)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t.fill_(0)  # the user's work before the read, on their stream
        with f.read_async(t, stream=s) as batch:
            total = t.to(torch.int64).sum()  # after it, on the same stream: sees the file's bytes
            s.synchronize()
            batch.check()
    assert int(total) == int(want.astype(np.int64).sum())


@cuda
def test_ferry_cuda_memory_is_a_tensor_without_a_copy(tmp_path):
    p = str(tmp_path / "dev.bin")
    want = random_file(p, 2 << 20)
    buf = ferry.empty(want.size, "cuda:0")
    with ferry.open(p) as f:
        assert f.read_into(buf) == want.size
    t = ferry.as_tensor(buf)
    assert t.device.type == "cuda" and t.data_ptr() == buf.ptr
    np.testing.assert_array_equal(t.cpu().numpy(), want)
    assert buf.__dlpack_device__() == (2, 0)  # kDLCUDA, device 0
    u = torch.from_dlpack(buf)
    assert u.device == torch.device("cuda:0") and u.data_ptr() == buf.ptr
    del buf, t
    gc.collect()
    np.testing.assert_array_equal(u.cpu().numpy(), want)  # the tensor keeps ferry's memory


@cuda
def test_a_checkpoint_into_cuda(tmp_path):
    p = str(tmp_path / "cuda.safetensors")
    tensors = {k: torch.from_numpy(v) for k, v in checkpoint().items()}
    ferry.safetensors.save(tensors, p)
    got = ferry.safetensors.load(p, device="cuda:0", verify=True, progress=False)
    for k, t in tensors.items():
        assert got[k].device.type == "cuda" and torch.equal(got[k].cpu(), t), k


def test_unified_memory_without_a_gpu_says_what_it_needs():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: test_examples runs the real thing")
    with pytest.raises(RuntimeError, match="needs torch with CUDA"):
        ferry.torch.use_unified_memory(device_capacity="64MiB")
    assert ferry.torch.info() == {}
