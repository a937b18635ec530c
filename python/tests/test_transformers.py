"""ferry.transformers.from_pretrained against transformers' own, on a small model saved in shards (where
transformers is installed: the GPU machine has it; Debian 12 does not package it)."""
import threading

import pytest
import torch

import ferry


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


def test_models_are_made_with_empty_parameters_and_real_buffers():
    """What from_pretrained builds the model with: parameters on the meta device (no memory, no initialization),
    buffers computed as the module makes them (then moved to the device); modules made by other threads meanwhile
    untouched, and nothing patched afterwards."""

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 4)
            self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)

    other = {}
    started, made = threading.Event(), threading.Event()

    def elsewhere():
        started.wait(10)
        other["m"] = torch.nn.Linear(3, 3)
        made.set()

    t = threading.Thread(target=elsewhere)
    t.start()
    with ferry.transformers._empty_parameters():
        started.set()
        assert made.wait(10)
        m = Rotary()
    t.join()
    assert m.proj.weight.is_meta and m.proj.bias.is_meta and isinstance(m.proj.weight, torch.nn.Parameter)
    assert not m.inv_freq.is_meta and torch.equal(m.inv_freq, 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    assert not other["m"].weight.is_meta, "another thread's module keeps its parameters"
    assert not torch.nn.Linear(2, 2).weight.is_meta, "the patch is gone afterwards"
    meta = torch.device("meta")  # a device every torch has: the buffers move, the parameters stay as they are
    ferry.transformers._buffers_to(m, meta)
    assert m.inv_freq.is_meta and m.proj.weight.is_meta and m._buffers.keys() == {"inv_freq"}


@pytest.mark.parametrize("device", ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("tied", [False, True])
def test_a_saved_model_loads_with_equal_logits(tmp_path, device, tied, transformers):
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=tied)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="200KB")
    assert len(list(tmp_path.glob("*.safetensors"))) >= 3, "several shards and an index"
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device, dtype=torch.bfloat16)
    got = ferry.transformers.from_pretrained(tmp_path, device=device, dtype=torch.bfloat16)
    assert type(got) is type(ref) and not got.training
    ids = torch.arange(32, device=device).reshape(1, 32) * 5 % cfg.vocab_size
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)
    if tied:
        assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()


def test_a_checkpoint_that_does_not_fit_the_model_is_a_format_error(tmp_path, transformers):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=256, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    sd = ferry.safetensors.load(tmp_path, progress=False)
    del sd["lm_head.weight"]
    for f in tmp_path.glob("*.safetensors*"):
        f.unlink()
    ferry.safetensors.save(sd, tmp_path / "model.safetensors", {"format": "pt"})
    with pytest.raises(ferry.FormatError, match="lm_head.weight"):
        ferry.transformers.from_pretrained(tmp_path, device="cpu")
