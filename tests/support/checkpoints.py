"""Small random checkpoints that the tests write themselves, in each supported format.

`write_tiny_checkpoint` is the one most tests serve: Llama 3's vocabulary (128256), so the Llama 3
tokenizer that ships with the llama-models package loads for it, and everything else small: it writes
and loads in seconds and generates hundreds of (random) tokens a second on one CPU core.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from model.rope import permute_qk_rows

VOCAB = 128256  # the Llama 3 tokenizer's size, so checkpoints load with the real tokenizer
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def hf_model(tie=True, rope=ROPE, seed=0, **overrides) -> transformers.LlamaForCausalLM:
    """A tiny random Llama with GQA and llama3 RoPE scaling; weights scaled up so logits are not flat."""
    torch.manual_seed(seed)
    fields = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, rope_parameters=rope)
    fields.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


def meta_state_dict(hf: transformers.LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The same weights in Meta's names, with q/k rows in Meta's interleaved RoPE layout."""
    c = hf.config

    def interleave(w, n_heads):  # half-split -> interleaved pairs (inverse of the load-time permute)
        return permute_qk_rows(w, n_heads, to="interleaved").clone()

    sd = {"tok_embeddings.weight": hf.model.embed_tokens.weight, "norm.weight": hf.model.norm.weight,
          "output.weight": hf.lm_head.weight}
    for i, layer in enumerate(hf.model.layers):
        a, m = layer.self_attn, layer.mlp
        sd |= {f"layers.{i}.attention.wq.weight": interleave(a.q_proj.weight, c.num_attention_heads),
               f"layers.{i}.attention.wk.weight": interleave(a.k_proj.weight, c.num_key_value_heads),
               f"layers.{i}.attention.wv.weight": a.v_proj.weight,
               f"layers.{i}.attention.wo.weight": a.o_proj.weight,
               f"layers.{i}.feed_forward.w1.weight": m.gate_proj.weight,
               f"layers.{i}.feed_forward.w2.weight": m.down_proj.weight,
               f"layers.{i}.feed_forward.w3.weight": m.up_proj.weight,
               f"layers.{i}.attention_norm.weight": layer.input_layernorm.weight,
               f"layers.{i}.ffn_norm.weight": layer.post_attention_layernorm.weight}
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def write_meta(hf, folder, scaled=True):
    folder.mkdir(parents=True, exist_ok=True)
    c = hf.config
    torch.save(meta_state_dict(hf), folder / "consolidated.00.pth")
    (folder / "params.json").write_text(json.dumps({
        "dim": c.hidden_size, "n_layers": c.num_hidden_layers, "n_heads": c.num_attention_heads,
        "n_kv_heads": c.num_key_value_heads, "vocab_size": c.vocab_size, "multiple_of": 32,
        "norm_eps": c.rms_norm_eps, "rope_theta": 500000.0, "use_scaled_rope": scaled}))
    return folder


def prompt_ids(n=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128000, (2, n), generator=g)


def write_tiny_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A random Llama 3-shaped model in Hugging Face format (config.json + model.safetensors)."""
    hf_model(seed=seed, num_hidden_layers=2).save_pretrained(folder)
    return folder
