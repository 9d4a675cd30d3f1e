"""Our Llama against Hugging Face transformers on the same random weights, in every checkpoint format."""

from __future__ import annotations

import json

import pytest
import torch
from support.checkpoints import ROPE, VOCAB, hf_model, prompt_ids, write_meta

from model import CheckpointError, KVCache, LlamaConfig, RopeScaling, generate, load_checkpoint
from model.rope import inv_freq


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits


def test_hf_safetensors_logits_match_transformers(reference, hf_folder):
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32)
    assert ckpt.format == "hf" and ckpt.config.rope_scaling == RopeScaling(factor=32.0)
    assert ckpt.model.output.weight is ckpt.model.tok_embeddings.weight  # tied after loading
    ids = prompt_ids()
    ours = ckpt.model(ids)
    assert ours.shape == (2, ids.shape[1], VOCAB)
    assert (ours - hf_logits(reference, ids)).abs().max().item() <= 1e-4


def test_llama3_rope_scaling_matters_at_long_positions(reference, hf_folder):
    """The parity above would also hold with plain RoPE unless positions are long: check they differ."""
    scaled = inv_freq(LlamaConfig.from_hf_config(hf_folder / "config.json"))
    plain = inv_freq(LlamaConfig.from_hf_config(hf_folder / "config.json").replace(rope_scaling=None))
    assert (scaled - plain).abs().max() > 1e-4
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32)
    ids = prompt_ids(n=600, seed=3)[:1]
    ours, theirs = ckpt.model(ids), hf_logits(reference, ids)
    assert (ours - theirs).abs().max().item() <= 1e-4
    ckpt.model.config = ckpt.model.config.replace(rope_scaling=None)
    ckpt.model.setup_rope(1024)
    assert (ckpt.model(ids) - theirs).abs().max().item() > 1e-3


def test_sharded_safetensors(reference, tmp_path):
    reference.save_pretrained(tmp_path, max_shard_size="20MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ckpt = load_checkpoint(tmp_path, dtype=torch.float32)
    ids = prompt_ids()
    assert (ckpt.model(ids) - hf_logits(reference, ids)).abs().max().item() <= 1e-4


def test_untied_head_and_default_rope(tmp_path):
    hf = hf_model(tie=False, rope={"rope_type": "default", "rope_theta": 10000.0}, seed=5)
    hf.save_pretrained(tmp_path)
    ckpt = load_checkpoint(tmp_path, dtype=torch.float32)
    assert ckpt.config.rope_scaling is None and not ckpt.config.tie_word_embeddings
    assert ckpt.model.output.weight is not ckpt.model.tok_embeddings.weight
    ids = prompt_ids()
    assert (ckpt.model(ids) - hf_logits(hf, ids)).abs().max().item() <= 1e-4


def test_transformers_4_style_config(reference, hf_folder, tmp_path):
    """The official Llama 3.2 config.json uses rope_scaling / rope_theta / torch_dtype."""
    for f in hf_folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    c = json.loads((hf_folder / "config.json").read_text())
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    c["rope_scaling"] = rope
    c["torch_dtype"] = c.pop("dtype", "float32")
    (tmp_path / "config.json").write_text(json.dumps(c))
    ckpt = load_checkpoint(tmp_path, dtype=torch.float32)
    assert ckpt.config.rope_theta == 500000.0 and ckpt.config.rope_scaling.factor == 32.0
    ids = prompt_ids()
    assert (ckpt.model(ids) - hf_logits(reference, ids)).abs().max().item() <= 1e-4


def test_meta_consolidated_pth(tmp_path):
    """Meta's q/k layout is converted at load; params.json carries no factor (8 below the 3.2 sizes)."""
    rope = dict(ROPE, factor=8.0)
    hf = hf_model(tie=False, rope=rope, seed=7)
    write_meta(hf, tmp_path / "original")
    ckpt = load_checkpoint(tmp_path, dtype=torch.float32)  # finds original/
    assert ckpt.format == "meta" and ckpt.config.rope_scaling.factor == 8.0
    assert ckpt.config.ffn_dim == 192
    ids = prompt_ids()
    assert (ckpt.model(ids) - hf_logits(hf, ids)).abs().max().item() <= 1e-4


def test_meta_params_rope_factor_by_size(tmp_path):
    for dim, factor in ((2048, 32.0), (3072, 32.0), (4096, 8.0)):
        (tmp_path / "params.json").write_text(json.dumps({
            "dim": dim, "n_layers": 2, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256,
            "multiple_of": 256, "ffn_dim_multiplier": 1.5 if dim == 2048 else 1.3, "norm_eps": 1e-5,
            "rope_theta": 500000.0, "use_scaled_rope": True}))
        assert LlamaConfig.from_meta_params(tmp_path / "params.json").rope_scaling.factor == factor
    assert LlamaConfig.from_meta_params(tmp_path / "params.json").ffn_dim == 14336  # 3.1 8B
    params = json.loads((tmp_path / "params.json").read_text()) | {"use_scaled_rope": False}
    (tmp_path / "params.json").write_text(json.dumps(params))
    assert LlamaConfig.from_meta_params(tmp_path / "params.json").rope_scaling is None


def test_presets_match_published_shapes():
    one_b = LlamaConfig.preset("llama3.2-1b")
    assert (one_b.dim, one_b.n_layers, one_b.n_heads, one_b.n_kv_heads, one_b.ffn_dim) == (2048, 16, 32, 8, 8192)
    assert one_b.rope_scaling.factor == 32.0 and one_b.tie_word_embeddings
    assert LlamaConfig.preset("llama3.2-3b").n_layers == 28
    assert LlamaConfig.preset("llama3.1-8b").rope_scaling.factor == 8.0
    with pytest.raises(ValueError, match="unknown preset"):
        LlamaConfig.preset("llama9")


def test_own_pth_with_config_json(reference, tmp_path):
    ckpt = load_checkpoint(_hf_folder_copy(reference, tmp_path / "hf"), dtype=torch.float32)
    folder = tmp_path / "ours"
    folder.mkdir()
    torch.save(ckpt.model.state_dict(), folder / "model.pth")
    (folder / "config.json").write_text(json.dumps(ckpt.config.to_hf_config()))
    ours = load_checkpoint(folder / "model.pth", dtype=torch.float32)
    assert ours.format == "pth"
    ids = prompt_ids()
    assert (ours.model(ids) - hf_logits(reference, ids)).abs().max().item() <= 1e-4


def _hf_folder_copy(hf, folder):
    hf.save_pretrained(folder)
    return folder


@pytest.mark.cpu_rules
def test_loading_is_memory_mapped_and_builds_on_meta(hf_folder):
    """bf16 file run in bf16: parameters are views of the mapped file, not copies."""
    from safetensors.torch import load_file, save_file
    sd = {k: v.to(torch.bfloat16) for k, v in load_file(hf_folder / "model.safetensors").items()}
    folder = hf_folder.parent / "bf16"
    folder.mkdir(exist_ok=True)
    save_file(sd, folder / "model.safetensors")
    (folder / "config.json").write_text((hf_folder / "config.json").read_text())
    ckpt = load_checkpoint(folder, dtype=torch.bfloat16)
    emb = ckpt.model.tok_embeddings.weight
    # One mapping of the whole file backs every weight matrix: each lies inside it (no copy).
    # (Norm weights, a few KB, are converted to the compute dtype.)
    matrices = [p for p in ckpt.model.parameters() if p.dim() == 2]
    assert len(matrices) == 1 + 7 * 3
    base = min(p.untyped_storage().data_ptr() for p in matrices)
    assert all(base <= p.data_ptr() < base + (folder / "model.safetensors").stat().st_size for p in matrices)
    assert emb.dtype == torch.bfloat16
    assert not any(t.is_meta for t in ckpt.model.state_dict().values())
    assert ckpt.model.rope is not None and not ckpt.model.rope.cos.is_meta


def test_greedy_generation_with_kv_cache_matches_transformers(reference, hf_folder):
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32)
    prompt = prompt_ids(n=12, seed=11)[0].tolist()
    theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30,
                                do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    gen = generate(ckpt, prompt, max_new_tokens=30, temperature=0.0, stop_ids=set())
    text = "".join(gen)
    assert gen.tokens == theirs.tolist()
    assert gen.finish_reason == "length" and text == ckpt.tokenizer.decode(gen.tokens)


@pytest.mark.cpu_rules
def test_prefix_reuse_takes_whole_prefill_chunks_and_gives_identical_greedy_output(hf_folder):
    from model.kv_cache import PREFILL_CHUNK as C
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32)
    first = prompt_ids(n=C + 20, seed=2)[0].tolist()
    gen = generate(ckpt, first, max_new_tokens=10, stop_ids=set())
    list(gen)
    assert gen.kv_cache.exact == C  # the second chunk was partial, the reply came from decode steps
    follow_up = first + gen.tokens + prompt_ids(n=C, seed=4)[0].tolist()
    reused = generate(ckpt, follow_up, max_new_tokens=15, stop_ids=set(), kv_cache=gen.kv_cache)
    list(reused)
    fresh = generate(ckpt, follow_up, max_new_tokens=15, stop_ids=set())
    list(fresh)
    assert reused.stats.reused_tokens == C
    assert reused.tokens == fresh.tokens
    # An edited history: the cache is cut back to the whole chunks of the common prefix.
    edited = first[:C + 5] + prompt_ids(n=30, seed=6)[0].tolist()
    again = generate(ckpt, edited, max_new_tokens=15, stop_ids=set(), kv_cache=reused.kv_cache)
    list(again)
    fresh = generate(ckpt, edited, max_new_tokens=15, stop_ids=set())
    list(fresh)
    assert again.stats.reused_tokens == C and again.tokens == fresh.tokens


def test_kv_cache_chunked_prefill_matches_full_forward(reference, hf_folder):
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32)
    ids = prompt_ids(n=40)[:1]
    cache = KVCache(ckpt.config, 64)
    with torch.no_grad():
        ckpt.model(ids[:, :17], start_pos=0, kv_cache=cache)
        tail = ckpt.model(ids[:, 17:], start_pos=17, kv_cache=cache)
    assert (tail - hf_logits(reference, ids)[:, 17:]).abs().max().item() <= 1e-4


def test_stop_token_and_cancel(hf_folder):
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32)
    prompt = prompt_ids(n=8)[0].tolist()
    probe = generate(ckpt, prompt, max_new_tokens=5, stop_ids=set())
    list(probe)
    stopped = generate(ckpt, prompt, max_new_tokens=5, stop_ids={probe.tokens[2]})
    list(stopped)
    assert stopped.finish_reason == "stop" and stopped.tokens == probe.tokens[:2]
    calls = []
    cancelled = generate(ckpt, prompt, max_new_tokens=20, stop_ids=set(),
                         should_stop=lambda: calls.append(1) or len(calls) > 4)
    list(cancelled)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.tokens) == 3


def test_prompt_longer_than_context_is_refused(hf_folder):
    from model import PromptTooLong
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32)
    with pytest.raises(PromptTooLong, match="context limit is 64"):
        generate(ckpt, list(range(64)), max_new_tokens=4, max_context=64)
    gen = generate(ckpt, list(range(60)), max_new_tokens=100, max_context=64, stop_ids=set())
    list(gen)
    assert len(gen.tokens) == 4 and gen.finish_reason == "length"
    assert gen.kv_cache.max_len == 64  # sized to prompt + reply, never the model's 131072


@pytest.mark.cpu_rules
def test_bfloat16_run_is_close_to_float32(reference, hf_folder):
    ckpt = load_checkpoint(hf_folder, dtype=torch.bfloat16)
    assert ckpt.model.tok_embeddings.weight.dtype == torch.bfloat16
    ids = prompt_ids()
    ours = ckpt.model(ids).float()
    theirs = hf_logits(reference, ids)
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9


# ---- bad input: one clear message naming the file ----

def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or folder"):
        load_checkpoint(tmp_path / "nope")


def test_folder_without_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="no checkpoint found.*notes.txt"):
        load_checkpoint(tmp_path)


def test_config_that_does_not_match_weights(hf_folder, tmp_path):
    for f in hf_folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    c = json.loads((hf_folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(c | {"intermediate_size": 256}))
    wrong = r"wrong shapes: model\.layers\.0\.mlp\.gate_proj\.weight: \(192, 64\) in the file, \(256, 64\)"
    with pytest.raises(CheckpointError, match=wrong):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(c | {"num_hidden_layers": 4}))
    with pytest.raises(CheckpointError, match=r"missing tensors: layers\.3\."):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(c | {"num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.2\."):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(c | {"num_key_value_heads": 3}))
    with pytest.raises(CheckpointError, match="num_key_value_heads=3 does not divide num_attention_heads=4"):
        load_checkpoint(tmp_path)


def test_truncated_safetensors(hf_folder, tmp_path):
    data = (hf_folder / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "config.json").write_text((hf_folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        load_checkpoint(tmp_path)


def test_pth_that_is_not_a_state_dict(hf_folder, tmp_path):
    (tmp_path / "config.json").write_text((hf_folder / "config.json").read_text())
    torch.save([torch.zeros(2)], tmp_path / "model.pth")
    with pytest.raises(CheckpointError, match="model.pth: expected a state dict"):
        load_checkpoint(tmp_path)


class Boom:
    def __reduce__(self):
        import os
        return (os.system, ("echo pwned > /dev/null",))


def test_pickle_that_would_run_code_is_refused(hf_folder, tmp_path):
    (tmp_path / "config.json").write_text((hf_folder / "config.json").read_text())
    torch.save({"x": Boom()}, tmp_path / "model.pth")
    with pytest.raises(CheckpointError, match="refused.*could run code"):
        load_checkpoint(tmp_path)


@pytest.mark.cpu_rules
def test_cancel_during_prefill_stops_between_chunks(hf_folder):
    from model.generation import PREFILL_CHUNK
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32)
    prompt = prompt_ids(n=PREFILL_CHUNK * 2 + 10, seed=8)[0].tolist()
    checks = []
    gen = generate(ckpt, prompt, max_new_tokens=5, stop_ids=set(),
                   should_stop=lambda: checks.append(1) or len(checks) > 1)
    assert list(gen) == [] and gen.finish_reason == "cancelled" and gen.tokens == []
    assert gen.kv_cache.tokens == prompt[:PREFILL_CHUNK]  # one chunk ran, the rest never did
    # A chunked prefill gives the same reply as a single pass would.
    full = generate(ckpt, prompt, max_new_tokens=5, stop_ids=set())
    list(full)
    with torch.no_grad():
        expected = ckpt.model(torch.tensor([prompt]))[0, -1].argmax().item()
    assert full.tokens[0] == expected


def test_control_tokens_are_kept_as_ids_but_not_shown(hf_folder):
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32)
    prompt = prompt_ids(n=8)[0].tolist()
    probe = generate(ckpt, prompt, max_new_tokens=6, stop_ids=set())
    list(probe)
    # Make the model's third token a control token by editing the output head's choice.
    python_tag = ckpt.tokenizer.special_tokens["<|python_tag|>"]
    gen = generate(ckpt, prompt, max_new_tokens=6, stop_ids=set())
    original = ckpt.model.decode

    def decode(*args, **kwargs):
        logits = original(*args, **kwargs)
        if len(gen.tokens) == 2:
            logits[0, python_tag] = 1e4  # the row that follows the last token
        return logits

    ckpt.model.decode = decode
    text = "".join(gen)
    assert gen.tokens[2] == python_tag
    assert "<|python_tag|>" not in text and text == gen.text
