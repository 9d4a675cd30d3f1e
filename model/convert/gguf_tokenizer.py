"""A GGUF's tokenizer (vocabulary, merges and token types in its metadata) as files the engine reads.

Two families of byte-level BPE files:
- Llama 3 (`tokenizer.ggml.pre` "llama-bpe"): rebuilt as Meta's `tokenizer.model` (tiktoken ranks),
  which `model.tokenizer.Tokenizer` reads; that class brings the Llama 3 pre-tokenizer and special
  tokens itself, so the file's special tokens must be exactly those. Chat template and special token
  names go to tokenizer_config.json.
- SmolLM-style ("smollm", "gpt2"): a Hugging Face tokenizer.json (+ tokenizer_config.json with the
  chat template, special_tokens_map.json), which `model.tokenizer.HFTokenizer` reads.
"""

from __future__ import annotations

import base64
from pathlib import Path

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from ..tokenizer import NAMED_SPECIAL_TOKENS, NUM_SPECIAL_TOKENS
from .folder import ConversionError, write_json
from .gguf_reader import metadata

# llama.cpp's token types (gguf.TokenType): control tokens are special, user-defined ones are whole words.
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
LLAMA3_PRE = "llama-bpe"

def is_llama3(reader: GGUFReader, path: Path) -> bool:
    return (metadata(reader, path, "tokenizer.ggml.model") == "gpt2"
            and metadata(reader, path, "tokenizer.ggml.pre", None) == LLAMA3_PRE)


def write_tokenizer(reader: GGUFReader, path: Path, folder: Path, config: dict) -> list[str]:
    """The tokenizer files for `folder`; returns their names."""
    if is_llama3(reader, path):
        (folder / "tokenizer.model").write_bytes(llama3_tokenizer_model(reader, path))
        write_json(folder / "tokenizer_config.json", tokenizer_config(reader, path, config, add_bos=True))
        return ["tokenizer.model", "tokenizer_config.json"]
    build_tokenizer(reader, path).save(str(folder / "tokenizer.json"))
    write_json(folder / "tokenizer_config.json", tokenizer_config(reader, path, config, add_bos=False))
    write_json(folder / "special_tokens_map.json", special_tokens(reader, path))
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


# ---- Llama 3: back to tiktoken ranks ---------------------------------------------------------------

def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character that stands for each byte -> that byte.

    Written out because `tokenizers` applies this table inside ByteLevel but does not expose it.
    Printable bytes stand for themselves; the others, in order, for the characters from U+0100 on.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def llama3_special_tokens() -> list[str]:
    """The 256 special tokens after the BPE ranks, in order, as model/tokenizer.py names them."""
    reserved = NUM_SPECIAL_TOKENS - len(NAMED_SPECIAL_TOKENS)
    return [*NAMED_SPECIAL_TOKENS, *(f"<|reserved_special_token_{2 + i}|>" for i in range(reserved))]


def llama3_tokenizer_model(reader: GGUFReader, path: Path) -> bytes:
    """Meta's tokenizer.model for the file's vocabulary: "<base64 bytes> <rank>" per line, rank = id.

    Byte-level BPE merges in rank order are what tiktoken does with ranks alone; the file's merges are
    checked to follow that order, so both give the same ids.
    """
    tokens = metadata(reader, path, "tokenizer.ggml.tokens")
    n = len(tokens) - NUM_SPECIAL_TOKENS
    special = llama3_special_tokens()
    if n <= 0 or tokens[n:] != special:
        differ = next((f"id {n + i}: {found!r}, expected {want!r}" for i, (found, want)
                       in enumerate(zip(tokens[max(n, 0):], special)) if found != want), f"{len(tokens)} tokens")
        raise ConversionError(f"{path}: a {LLAMA3_PRE} tokenizer should end with Llama 3's {NUM_SPECIAL_TOKENS} "
                              f"special tokens (<|begin_of_text|> ...); found {differ}")
    decode = byte_decoder()
    try:
        ranks = [bytes(decode[c] for c in token) for token in tokens[:n]]
    except KeyError as e:
        raise ConversionError(f"{path}: token {e.args[0]!r} is not in the byte-level alphabet of a "
                              f"{LLAMA3_PRE} vocabulary") from None
    if len(set(ranks)) != n:
        raise ConversionError(f"{path}: the {LLAMA3_PRE} vocabulary spells some token twice")
    check_merges_follow_ranks(reader, path, {token: i for i, token in enumerate(tokens[:n])})
    return b"".join(base64.b64encode(token) + b" %d\n" % rank for rank, token in enumerate(ranks))


def check_merges_follow_ranks(reader: GGUFReader, path: Path, ids: dict[str, int]) -> None:
    """Each merge makes a token of the vocabulary, and merges come in the order of those tokens' ids."""
    last = -1
    for i, merge in enumerate(metadata(reader, path, "tokenizer.ggml.merges")):
        left, _, right = merge.partition(" ")
        made = ids.get(left + right)
        if made is None or made < last:
            raise ConversionError(f"{path}: merge {i} {merge!r} makes {'no token' if made is None else f'id {made}'}"
                                  f" after id {last}; expected merges in the order of the ids they make, "
                                  f"as Llama 3's tokenizer has them")
        last = made


# ---- SmolLM-style: a tokenizers.Tokenizer ---------------------------------------------------------

def smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """llama.cpp's "smollm" split (as StarCoder's): every digit alone, then GPT-2's regex."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


PRE_TOKENIZERS = {  # tokenizer.ggml.pre -> the split the merges were learned on
    "smollm": smollm_pre_tokenizer,
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}


def build_tokenizer(reader: GGUFReader, path: Path) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from the vocabulary, merges and token types in the file."""
    kind = metadata(reader, path, "tokenizer.ggml.model")
    pre = metadata(reader, path, "tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ConversionError(f"{path}: tokenizer model={kind!r} pre={pre!r} is not supported; expected "
                              f"model 'gpt2' (byte-level BPE) with pre in {sorted([*PRE_TOKENIZERS, LLAMA3_PRE])}")
    if metadata(reader, path, "tokenizer.ggml.add_bos_token", False):
        raise ConversionError(f"{path}: tokenizer.ggml.add_bos_token=true is not supported for pre={pre!r}; "
                              "expected false")
    tokens = metadata(reader, path, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in metadata(reader, path, "tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = metadata(reader, path, "tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    return tokenizer


def special_tokens(reader: GGUFReader, path: Path) -> dict[str, str]:
    tokens = metadata(reader, path, "tokenizer.ggml.tokens")
    ids = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
           "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    found = {name: metadata(reader, path, f"tokenizer.ggml.{key}", None) for name, key in ids.items()}
    return {name: tokens[i] for name, i in found.items() if i is not None}


def tokenizer_config(reader: GGUFReader, path: Path, config: dict, add_bos: bool) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens(reader, path),
        "add_bos_token": add_bos,
        "add_eos_token": bool(metadata(reader, path, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": metadata(reader, path, "tokenizer.chat_template", None),
    }
