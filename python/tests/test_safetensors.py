"""ferry.safetensors as code written for safetensors meets it: files written by hand (the format's own layout),
Hugging Face folders with an index, safe_open's lazy handle and slices, malformed files and bad arguments."""
import json
import os
import pathlib
import signal
import struct

import numpy as np
import pytest
import torch

import ferry
from ferry.safetensors import Shard, safe_open
from st_files import header_file, write_numpy

rng = np.random.default_rng(11)
def arrays():
    return {
        "model.embed.weight": rng.standard_normal((96, 40)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(40).astype(np.float16),
        "model.ids": rng.integers(-9, 9, (6, 5, 4)).astype(np.int64),
        "model.mask": rng.integers(0, 2, 33).astype(bool),
        "model.scalar": np.array(3.5, dtype=np.float64),
        "model.empty": np.zeros((0, 4), dtype=np.float32),
        "lm_head.weight": rng.standard_normal((64, 40)).astype(np.float32),
    }


def equal(t, a):
    assert tuple(t.shape) == a.shape, (tuple(t.shape), a.shape)
    np.testing.assert_array_equal(t.cpu().numpy(), a)


# ---- the format rules: each malformed file is a FormatError naming the file and the tensor ----------------------

def f32(name, shape, begin, end):
    return {name: {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}}


MALFORMED = {
    "overlap": ({**f32("a", [4], 0, 16), **f32("b", [4], 8, 24)}, 24, "'b'.*overlaps"),
    "gap": ({**f32("a", [4], 0, 16), **f32("b", [4], 20, 36)}, 36, "'b'.*gap of 4 bytes"),
    "trailing": (f32("a", [4], 0, 16), 20, "4 bytes after the last tensor"),
    "span": (f32("a", [4], 0, 12), 12, "'a'.*span 12 bytes.*16 bytes"),
    "dtype": ({"a": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}}, 16, "'a'.*dtype 'F33'"),
    "shape": ({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, 16, "'a'.*shape"),
    "shape-type": ({"a": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}, 16, "'a'.*shape"),
    "offsets": ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, 16, "'a'.*data_offsets"),
    "no-offsets": ({"a": {"dtype": "F32", "shape": [4]}}, 16, "'a'.*no data_offsets"),
    "past-end": (f32("a", [8], 0, 32), 16, "'a'.*cut short"),
    "metadata": ({**f32("a", [4], 0, 16), "__metadata__": {"step": 7}}, 16, r"__metadata__\['step'\].*not a string"),
    "entry": ({"a": [1, 2]}, 16, "'a'.*not an object"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_headers_are_format_errors(tmp_path, case):
    header, nbytes, message = MALFORMED[case]
    p = header_file(tmp_path / f"{case}.safetensors", header, bytes(nbytes))
    with pytest.raises(ferry.FormatError, match=message) as e:
        ferry.safetensors.load(p, progress=False)
    assert p in str(e.value) and e.value.code == "invalid_format"
    assert isinstance(e.value, ferry.Error) and isinstance(e.value, ValueError)
    with pytest.raises(ferry.FormatError, match=message):
        safe_open(p, framework="pt")


def test_raw_header_faults(tmp_path):
    cases = {
        "dup": (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
                4, "names 'a' twice"),
        "json": (b'{"a": {"dtype": "F32",', 0, "not JSON"),
        "utf8": (b'{"\xff": 1}', 0, "not UTF-8"),
        "array": (b"[1, 2]", 0, r"start with '\{'"),
        "deep": (b"{" + b'"a":' * 1 + b"[" * 5000 + b"]" * 5000 + b"}", 0, "nests too deeply|not an object|not JSON"),
    }
    for name, (raw, nbytes, message) in cases.items():
        p = header_file(tmp_path / f"{name}.safetensors", raw, bytes(nbytes))
        with pytest.raises(ferry.FormatError, match=message):
            ferry.safetensors.load(p, progress=False)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(ferry.FormatError, match="too short"):
        ferry.safetensors.load(short, progress=False)
    big = tmp_path / "big.safetensors"
    big.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ferry.FormatError, match="over safetensors' limit"):
        ferry.safetensors.load(big, progress=False)
    long = tmp_path / "long.safetensors"
    long.write_bytes(struct.pack("<Q", 4096) + b"{}")
    with pytest.raises(ferry.FormatError, match="does not fit"):
        ferry.safetensors.load(long, progress=False)


def test_strict_false_accepts_gaps_and_trailing_bytes(tmp_path):
    data = np.arange(8, dtype=np.float32).tobytes()
    header = {**f32("a", [2], 0, 8), **f32("b", [2], 16, 24)}
    p = header_file(tmp_path / "gappy.safetensors", header, data + b"trailing")
    with pytest.raises(ferry.FormatError, match="gap"):
        ferry.safetensors.load(p, progress=False)
    got = ferry.safetensors.load(p, progress=False, strict=False)
    equal(got["a"], np.array([0, 1], dtype=np.float32))
    equal(got["b"], np.array([4, 5], dtype=np.float32))


# ---- arguments ---------------------------------------------------------------------------------------------------

def test_paths_names_and_special_files(tmp_path):
    a = arrays()
    p = write_numpy(tmp_path / "m.safetensors", a)
    got = ferry.safetensors.load(pathlib.Path(p), progress=False)  # os.PathLike
    equal(got["model.embed.weight"], a["model.embed.weight"])
    with pytest.raises(ferry.ArgumentError, match="one string"):
        ferry.safetensors.load(p, names="lm_head.weight", progress=False)
    got = ferry.safetensors.load(p, names=(n for n in ["lm_head.weight"]), progress=False)
    assert list(got) == ["lm_head.weight"]
    with pytest.raises(ferry.ArgumentError, match="no tensor named 'nope'"):
        ferry.safetensors.load(p, names=["nope"], progress=False)
    with pytest.raises(ferry.ArgumentError, match="str or os.PathLike"):
        ferry.safetensors.load(42, progress=False)
    with pytest.raises(ferry.Error, match="cannot open"):
        ferry.safetensors.load(tmp_path / "missing.safetensors", progress=False)
    with pytest.raises(ferry.ArgumentError, match="str or os.PathLike"):
        ferry.open(3.5)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("a FIFO blocked"))
    signal.alarm(10)
    try:
        with pytest.raises(ferry.ArgumentError, match="not a regular file"):
            ferry.safetensors.load(fifo, progress=False)
        with pytest.raises(ferry.Error, match="not a regular file"):
            ferry.open(str(fifo))
    finally:
        signal.alarm(0)
    with pytest.raises(ferry.ArgumentError, match="timeout"):
        ferry.safetensors.load(p, progress=False, timeout=-1)
    with pytest.raises(ferry.Error, match="unknown unit"):
        ferry.safetensors.load(p, progress=False, timeout="5 parsecs", mmap=False)


def test_durations_are_parsed_once_by_the_settings_code():
    from ferry import _ferry
    assert _ferry.parse_duration("1min") == 60.0
    assert _ferry.parse_duration("250ms") == 0.25
    assert _ferry.parse_duration("30s") == 30.0
    with pytest.raises(ferry.Error, match="unknown unit"):
        _ferry.parse_duration("3 fortnights")


def test_shard_rules_that_cannot_fit_are_errors(tmp_path):
    a = arrays()
    p = write_numpy(tmp_path / "m.safetensors", a)
    for bad, message in [(lambda: Shard(4, 4, 0), r"rank=4 is outside \[0, 4\)"), (lambda: Shard(-1, 4, 0), "rank=-1"),
                         (lambda: Shard(0, 0, 0), "world=0"), (lambda: Shard(0, 2, "x"), "dim must be an int"),
                         (lambda: Shard(0.5, 2, 0), "rank must be an int")]:
        with pytest.raises(ferry.ArgumentError, match=message):
            bad()
    with pytest.raises(ferry.ArgumentError, match="'model.norm.weight' has 1 dimension"):
        ferry.safetensors.load(p, names=["model.norm.weight"], shard=Shard(0, 2, 1), progress=False)
    with pytest.raises(ferry.ArgumentError, match="'model.embed.weight' has 2 dimension"):
        ferry.safetensors.load(p, names=["model.embed.weight"], shard=Shard(0, 2, 2), progress=False)
    with pytest.raises(ferry.ArgumentError, match="returned 'x' for tensor"):
        ferry.safetensors.load(p, names=["model.embed.weight"], shard=Shard(0, 2, lambda n: "x"), progress=False)
    with pytest.raises(ferry.ArgumentError, match="'model.ids' dim 1 of size 5 does not split"):
        ferry.safetensors.load(p, names=["model.ids"], shard=Shard(0, 2, 1), progress=False)


@pytest.mark.parametrize("mmap", [True, False])
def test_shards_along_every_dim_equal_the_slices(tmp_path, mmap):
    t = {"w3": rng.standard_normal((8, 6, 10)).astype(np.float32), "w2": rng.standard_normal((300, 40)).astype(np.float16),
         "wide": rng.standard_normal((5000, 8)).astype(np.float32)}
    p = write_numpy(tmp_path / "m.safetensors", t)
    for dim in (0, 1, -1):
        for world in (1, 2):
            for rank in range(world):
                dims = {n: dim for n in t if t[n].shape[dim % t[n].ndim] % world == 0}
                got = ferry.safetensors.load(p, shard=Shard(rank, world, lambda n: dims.get(n)), progress=False, mmap=mmap)
                for n, a in t.items():
                    if n not in dims:
                        equal(got[n], a)
                        continue
                    d = dim % a.ndim
                    part = a.shape[d] // world
                    equal(got[n], np.take(a, range(rank * part, (rank + 1) * part), axis=d))


# ---- folders and indexes ------------------------------------------------------------------------------------

def hf_folder(root, shards=3, index=True):
    """A Hugging Face style folder: tensors spread over `shards` files, with model.safetensors.index.json."""
    a = arrays()
    names = list(a)
    root.mkdir(exist_ok=True)
    weight_map = {}
    for s in range(shards):
        part = {n: a[n] for n in names[s::shards]}
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        write_numpy(root / fname, part, {"format": "pt"})
        weight_map.update({n: fname for n in part})
    if index:
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    (root / "config.json").write_text("{}")
    return a, weight_map


@pytest.mark.parametrize("index", [True, False])
def test_a_folder_of_shards_loads_as_one(tmp_path, index):
    a, _ = hf_folder(tmp_path / "model", index=index)
    for target in [tmp_path / "model"] + ([tmp_path / "model" / "model.safetensors.index.json"] if index else []):
        for mmap in (True, False):
            got = ferry.safetensors.load(target, progress=False, mmap=mmap)
            assert set(got) == set(a)
            for n in a:
                equal(got[n], a[n])
    with safe_open(tmp_path / "model", framework="pt") as f:
        assert f.keys() == sorted(a)
        assert f.metadata() == {"format": "pt"}
        equal(f.get_tensor("lm_head.weight"), a["lm_head.weight"])


def test_many_tensors_go_out_in_batches_as_they_are_planned(tmp_path, monkeypatch):
    """A load's reads start while the rest of its plan is made: a batch per 32 tensors (or 64 MiB), every tensor
    still equal, every byte read once."""
    a = {f"layers.{i}.weight": rng.standard_normal((i % 7 + 1, 9)).astype(np.float32) for i in range(150)}
    p = write_numpy(tmp_path / "many.safetensors", a)
    batches = []
    real = ferry._batch

    def counting(requests, *args, **kw):
        requests = list(requests)
        batches.append(len(requests))
        return real(requests, *args, **kw)

    monkeypatch.setattr(ferry, "_batch", counting)
    stats = {}
    got = ferry.safetensors.load(p, progress=False, mmap=False, stats=stats)
    assert batches == [32, 32, 32, 32, 22]
    assert stats["bytes_read"] == sum(x.nbytes for x in a.values())
    for n in a:
        equal(got[n], a[n])


def test_an_index_that_disagrees_with_its_shards_is_a_format_error(tmp_path):
    root = tmp_path / "model"
    a, wm = hf_folder(root)
    idx = root / "model.safetensors.index.json"
    wrong = dict(wm)
    wrong["lm_head.weight"] = next(f for f in set(wm.values()) if f != wm["lm_head.weight"])
    idx.write_text(json.dumps({"weight_map": wrong}))
    with pytest.raises(ferry.FormatError, match="puts tensor 'lm_head.weight' in"):
        ferry.safetensors.load(root, progress=False)
    idx.write_text(json.dumps({"weight_map": {**wm, "ghost": wm["lm_head.weight"]}}))
    with pytest.raises(ferry.FormatError, match="'ghost', which no shard holds"):
        ferry.safetensors.load(root, progress=False)
    idx.write_text(json.dumps({"weight_map": {"x": "../escape.safetensors"}}))
    with pytest.raises(ferry.FormatError, match="not a file beside the index"):
        ferry.safetensors.load(root, progress=False)
    # The same tensor in two shards.
    idx.unlink()
    write_numpy(root / "extra.safetensors", {"lm_head.weight": a["lm_head.weight"]})
    with pytest.raises(ferry.FormatError, match="'lm_head.weight' is in .* too"):
        ferry.safetensors.load(root, progress=False)


# ---- safe_open --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mmap", [True, False])
def test_safe_open_like_safetensors(tmp_path, mmap):
    a = arrays()
    p = write_numpy(tmp_path / "m.safetensors", a, {"format": "pt", "note": "by hand"})
    with safe_open(p, framework="pt", device="cpu", mmap=mmap) as f:
        assert f.keys() == sorted(a)
        assert f.metadata() == {"format": "pt", "note": "by hand"}
        for n in a:
            equal(f.get_tensor(n), a[n])
        s = f.get_slice("model.ids")
        assert s.get_shape() == [6, 5, 4] and s.get_dtype() == "I64"
        full = a["model.ids"]
        keys = [np.s_[1:4], np.s_[:, 2:4], np.s_[..., 1:3], np.s_[2], np.s_[-1, :, 3], np.s_[::2, 1:5:2],
                np.s_[1:1], np.s_[:, :, :], np.s_[4:, ::3, -2:]]
        for k in keys:
            equal(s[k], full[k])
        e = f.get_slice("model.embed.weight")
        equal(e[10:20], a["model.embed.weight"][10:20])
        equal(e[:, 8:16], a["model.embed.weight"][:, 8:16])
        with pytest.raises(ferry.ArgumentError, match="out of range"):
            s[6]
        with pytest.raises(ferry.ArgumentError, match="indexes 4"):
            s[0, 0, 0, 0]
        with pytest.raises(ferry.ArgumentError, match="no tensor named 'x'"):
            f.get_tensor("x")
        everything = f.get_tensors()
        assert set(everything) == set(a)
    no_meta = write_numpy(tmp_path / "plain.safetensors", {"x": np.ones(3, dtype=np.float32)})
    with safe_open(no_meta, framework="pt") as f:
        assert f.metadata() is None
    with pytest.raises(ferry.ArgumentError, match="framework"):
        safe_open(p, framework="np")


def test_a_wide_slice_is_cut_from_spans_not_read_row_by_row(tmp_path):
    w = rng.standard_normal((20000, 16)).astype(np.float32)
    p = write_numpy(tmp_path / "wide.safetensors", {"w": w})
    from ferry.safetensors import _Plan, _Set
    s = _Set(p, True)
    try:
        out = torch.empty((20000, 8), dtype=torch.float32)
        plan = _Plan(torch, torch.device("cpu"))
        plan.read_to(s.entries["w"], out, [(0, 20000, 1), (8, 16, 1)])
        assert len(plan.direct) == 0 and len(plan.windows) == 1, "one span, not 20000 reads"
        plan.run(timeout=None, progress=None, what="w")
    finally:
        s.close()
    equal(out, w[:, 8:16])


def test_cpu_tensors_map_the_file_and_are_private(tmp_path):
    a = {"w": rng.standard_normal((256, 256)).astype(np.float32)}
    p = write_numpy(tmp_path / "m.safetensors", a)
    got = ferry.safetensors.load(p, progress=False)
    got["w"] += 1  # copy-on-write: the tensor changes, the file does not
    again = ferry.safetensors.load(p, progress=False)
    equal(again["w"], a["w"])
    equal(got["w"], a["w"] + 1)


def test_a_misaligned_tensor_is_copied_not_refused(tmp_path):
    x = np.arange(3, dtype=np.uint8)
    y = rng.standard_normal(10).astype(np.float32)  # at data offset 3: not 4-byte aligned
    p = write_numpy(tmp_path / "odd.safetensors", {"x": x, "y": y})
    got = ferry.safetensors.load(p, progress=False)
    equal(got["y"], y)
    with safe_open(p, framework="pt") as f:
        equal(f.get_slice("y")[2:5], y[2:5])


def test_save_refuses_metadata_safetensors_would_refuse(tmp_path):
    with pytest.raises(ferry.ArgumentError, match="metadata"):
        ferry.safetensors.save({"a": torch.zeros(2)}, tmp_path / "m.safetensors", {"step": 3})
    ferry.safetensors.save({"a": torch.zeros(2)}, tmp_path / "m.safetensors", {"step": "3"})
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        assert f.metadata()["step"] == "3"
