"""ferry.transformers.from_pretrained against transformers' own, on a small model saved in shards (where
transformers is installed: the GPU machine has it; Debian 12 does not package it)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import ferry  # noqa: E402


@pytest.mark.parametrize("device", ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("tied", [False, True])
def test_a_saved_model_loads_with_equal_logits(tmp_path, device, tied):
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


def test_a_checkpoint_that_does_not_fit_the_model_is_a_format_error(tmp_path):
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
