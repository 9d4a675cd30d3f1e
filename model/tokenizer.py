"""Text <-> token ids.

`Tokenizer` is the Llama 3 tokenizer: tiktoken byte-level BPE over Meta's `tokenizer.model`, plus 256
special tokens. `HFTokenizer` runs a Hugging Face `tokenizer.json` for other checkpoints. Both read the
text given to `encode` as plain text: a user who types "<|eot_id|>" gets the pieces of that string, never
the control token. `load_tokenizer` finds the right one for a checkpoint.
"""

import binascii
import functools
import hashlib
import importlib.util
import json
import re
import weakref
from pathlib import Path

import tiktoken
import tokenizers

from .checkpoint_files import tokenizer_file
from .unicode import valid_unicode


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable, or not the format its name says."""


# Meta's pre-tokenizer regex for Llama 3 (llama_models/llama3/tokenizer.py).
PAT_STR = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_SPECIAL_TOKENS = 256
# The first special ids, in order from len(ranks) = 128000; the rest are <|reserved_special_token_2|> and up.
NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|image|>",
)
# tiktoken panics above 400k chars and crawls on very long runs of one character class, so Meta cuts the
# text first. Cutting changes the ids, so we cut at exactly the same places.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
LONG_RUN = re.compile(rf"\s{{{MAX_RUN_CHARS + 1},}}|\S{{{MAX_RUN_CHARS + 1},}}")  # \s is str.isspace


def split_for_tiktoken(text: str):
    """Meta's cuts: 400k-char chunks, then a new piece every 25k chars inside a longer whitespace or
    non-whitespace run (counted from the start of the run)."""
    for chunk_start in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[chunk_start:chunk_start + MAX_ENCODE_CHARS]
        start = 0
        for run in LONG_RUN.finditer(chunk):
            for cut in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield chunk[start:cut]
                start = cut
        yield chunk[start:]


def parse_bpe_ranks(data: bytes) -> dict[bytes, int]:
    """A tiktoken BPE file's ranks ("<base64 token> <rank>" per line); ValueError naming the first line that is not
    one, or the ranks' gaps or repeats. Read here rather than by tiktoken's `load_tiktoken_bpe`, which keeps a copy of every
    file it reads in the temporary folder (data-gym-cache, by a hash of the path): a copy for each checkpoint."""
    fields = data.split()
    try:  # the whole file at once (0.1 s for 128,000 lines): two fields a line, every token strict base64
        if len(fields) != 2 * sum(map(bool, data.splitlines())):
            raise ValueError
        decode = functools.partial(binascii.a2b_base64, strict_mode=True)
        ranks = dict(zip(map(decode, fields[0::2]), map(int, fields[1::2]), strict=True))
    except ValueError:  # also binascii.Error: line by line, to name the first line that is not one
        ranks = {}
        for number, line in enumerate(data.splitlines(), 1):
            if not line:
                continue
            try:
                token, rank = line.split()
                ranks[binascii.a2b_base64(token, strict_mode=True)] = int(rank)
            except ValueError as e:
                raise ValueError(f"expected a tiktoken BPE file (lines of '<base64 token> <rank>'), line {number} is "
                                 f"not one ({e}); a SentencePiece tokenizer.model (Llama 1/2) is not supported") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"expected ranks 0..{len(ranks) - 1}, each once, found gaps or repeats")
    return ranks


def load_bpe_ranks(path: Path) -> dict[bytes, int]:
    """Read a tiktoken BPE file (`parse_bpe_ranks`)."""
    try:
        return parse_bpe_ranks(path.read_bytes())
    except ValueError as e:
        raise TokenizerError(f"{path}: {e}") from None




def special_token_ids(n_ranks: int) -> dict[str, int]:
    """The 256 special tokens' ids, from n_ranks on."""
    n_reserved = NUM_SPECIAL_TOKENS - len(NAMED_SPECIAL_TOKENS)
    names = (*NAMED_SPECIAL_TOKENS, *(f"<|reserved_special_token_{2 + i}|>" for i in range(n_reserved)))
    return {name: n_ranks + i for i, name in enumerate(names)}


_ENCODINGS = weakref.WeakValueDictionary()  # sha256 of a tokenizer.model's bytes -> its Encoding, while one is in use


def llama3_encoding(data: bytes) -> tiktoken.Encoding:
    """The tiktoken Encoding of a tokenizer.model's bytes. Every Llama 3.x checkpoint ships the same bytes, and an
    Encoding is never changed once built (0.2 s and 60 MB for 128,000 ranks), so the models in use share one: a
    draft model and its target, two models loaded at once, or a model loaded while another still holds it."""
    key = hashlib.sha256(data).digest()
    encoding = _ENCODINGS.get(key)
    if encoding is None:
        ranks = parse_bpe_ranks(data)
        encoding = tiktoken.Encoding(name="llama3", pat_str=PAT_STR, mergeable_ranks=ranks,
                                     special_tokens=special_token_ids(len(ranks)))
        _ENCODINGS[key] = encoding
    return encoding


class Tokenizer:
    """Llama 3 tokenizer (Meta's tokenizer.model), id for id the same as llama_models 0.3.0."""

    name = "llama3"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise TokenizerError(f"{self.path}: no such tokenizer.model file")
        try:
            self.model = llama3_encoding(self.path.read_bytes())
        except ValueError as e:
            raise TokenizerError(f"{self.path}: {e}") from None
        self.special_tokens = special_token_ids(self.model.n_vocab - NUM_SPECIAL_TOKENS)
        self.vocab_size = self.model.n_vocab
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.eot_id = self.special_tokens["<|eot_id|>"]  # end of turn
        self.eom_id = self.special_tokens["<|eom_id|>"]  # end of message (the model waits for a tool result)
        self.pad_id = self.special_tokens["<|finetune_right_pad_id|>"]
        self.stop_ids = {self.eos_id, self.eom_id, self.eot_id}

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of `text` as plain text (special-token names in it are spelled out), with optional bos/eos."""
        ids = [self.bos_id] if bos else []
        for piece in split_for_tiktoken(text):
            ids += self.model.encode_ordinary(piece)
        return ids + [self.eos_id] if eos else ids

    def decode(self, ids) -> str:
        """Text of `ids`; special tokens read as their names, invalid UTF-8 as U+FFFD."""
        return self.model.decode(list(ids))

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for, indexed by id (`vocab_size` entries); special tokens as their names."""
        return [self.model.decode_single_token_bytes(i) for i in range(self.vocab_size)]


class HFTokenizer:
    """A Hugging Face tokenizer.json in `folder`, with the interface of `Tokenizer`.

    bos/eos come from tokenizer_config.json, else generation_config.json, else config.json; `stop_ids` is the
    eos token of tokenizer_config.json plus every eos_token_id of the other two.
    """

    name = "huggingface"

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        path = self.folder / "tokenizer.json"
        try:
            self.model = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a missing or malformed file
            raise TokenizerError(f"{path}: cannot read a Hugging Face tokenizer ({e})") from None
        # The same normalizer, pre-tokenizer and BPE without the added tokens: tokenizers cuts added tokens
        # (special or not) out of any text, and its encode_special_tokens flag only spares the special ones.
        self.plain = tokenizers.Tokenizer(self.model.model)
        self.plain.normalizer = self.model.normalizer
        self.plain.pre_tokenizer = self.model.pre_tokenizer
        added = sorted(self.model.get_added_tokens_decoder().items(), key=lambda item: -len(item[1].content))
        self.added_tokens = {token.content: i for i, token in added}
        self.special_tokens = {token.content: i for i, token in added if token.special}
        # Added tokens, longest first, each in its own group, with the whitespace they strip on either side.
        self._added_ids = [i for i, _ in added]
        self._added_pattern = re.compile("|".join(
            (r"\s*" if t.lstrip else "") + f"({re.escape(t.content)})" + (r"\s*" if t.rstrip else "")
            for _, t in added) or "(?!)")
        self.vocab_size = self.model.get_vocab_size(with_added_tokens=True)

        config = read_json(self.folder / "tokenizer_config.json")
        generation = read_json(self.folder / "generation_config.json")
        model_config = read_json(self.folder / "config.json")
        self.bos_token = token_content(config.get("bos_token"))
        self.eos_token = token_content(config.get("eos_token"))
        bos_ids = token_ids(generation.get("bos_token_id")) + token_ids(model_config.get("bos_token_id"))
        eos_ids = token_ids(generation.get("eos_token_id")) + token_ids(model_config.get("eos_token_id"))
        self.bos_id = self.token_id(self.bos_token) if self.bos_token else next(iter(bos_ids), None)
        self.eos_id = self.token_id(self.eos_token) if self.eos_token else next(iter(eos_ids), None)
        if self.eos_id is None:
            raise TokenizerError(f"{self.folder}: expected an eos token in tokenizer_config.json, "
                                 f"generation_config.json or config.json, found none")
        self.eot_id = self.eos_id  # instruct models end a turn with their eos (ChatML: <|im_end|>)
        self.eom_id = None
        self.pad_id = self.token_id(token_content(config.get("pad_token")))
        self.stop_ids = {self.eos_id, *eos_ids}

    def token_id(self, token: str | None) -> int | None:
        """The id of a token named in tokenizer_config.json."""
        if token is None:
            return None
        token_id = self.model.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{self.folder}: tokenizer_config.json names {token!r}, "
                                 f"which tokenizer.json does not have")
        return token_id

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of `text` as plain text (added-token names in it are spelled out), with optional bos/eos.
        Lone surrogates (a str that is not valid Unicode) read as U+FFFD, as tiktoken reads them."""
        # encode_batch lets go of the GIL while it works (encode holds it): a long text tokenized on a
        # worker thread leaves the event loop and the other threads running.
        ids = self.plain.encode_batch([valid_unicode(text)], add_special_tokens=False)[0].ids
        if bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids + [self.eos_id] if eos else ids

    def split_added(self, text: str) -> list[str | int]:
        """Cut `text` at added tokens, as tokenizers does before BPE: text stays str, added tokens become ids.
        (Tokens flagged single_word or normalized are matched like the others.)"""
        pieces, start = [], 0
        for match in self._added_pattern.finditer(text):
            pieces += [text[start:match.start()], self._added_ids[match.lastindex - 1]]
            start = match.end()
        pieces.append(text[start:])
        return [piece for piece in pieces if piece != ""]

    def decode(self, ids) -> str:
        """Text of `ids`, special tokens included."""
        return self.model.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for, indexed by id (`vocab_size` entries); added tokens as their text.

        A vocabulary token is spelled in the alphabet of the decoder in tokenizer.json: byte-level (GPT-2,
        Llama 3, SmolLM) or SentencePiece's "\u2581" for a space with "<0xNN>" byte tokens (Llama 2, Mistral).
        """
        path = self.folder / "tokenizer.json"
        decoder = read_json(path).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        added = {i: token.content for i, token in self.model.get_added_tokens_decoder().items()}
        pieces = [added.get(i) or self.model.id_to_token(i) or "" for i in range(self.vocab_size)]
        if "ByteLevel" in kinds:
            byte_of = {char: byte for byte, char in enumerate(byte_level_alphabet())}
            try:
                return [piece.encode() if i in added else bytes(byte_of[c] for c in piece)
                        for i, piece in enumerate(pieces)]
            except KeyError as e:
                raise TokenizerError(f"{path}: expected byte-level characters in the vocabulary, found "
                                     f"{e.args[0]!r}") from None
        if kinds & {"Metaspace", "ByteFallback", "Replace"}:
            return [piece.encode() if i in added else
                    bytes([int(piece[3:5], 16)]) if SENTENCEPIECE_BYTE.fullmatch(piece) else
                    piece.replace("\u2581", " ").encode() for i, piece in enumerate(pieces)]
        raise TokenizerError(f"{path}: expected a ByteLevel, Metaspace or ByteFallback decoder to read the "
                             f"tokens' bytes, found {sorted(k for k in kinds if k) or 'none'}")


SENTENCEPIECE_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def byte_level_alphabet() -> list[str]:
    """The character that stands for each byte 0..255 in a byte-level BPE vocabulary (GPT-2's map:
    printable bytes are themselves, the other 68 are chr(256 + n) in order). Written here because
    tokenizers applies this map inside its ByteLevel pre-tokenizer and decoder but does not expose it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def token_content(token) -> str | None:
    """A token as tokenizer_config.json writes it: a string, or a dict with "content", or null."""
    return token.get("content") if isinstance(token, dict) else token


def token_ids(value) -> list[int]:
    """An id field of config.json or generation_config.json: an int, a list of ints, or null."""
    return [] if value is None else [int(i) for i in (value if isinstance(value, list) else [value])]


LLAMA3_VOCAB_SIZE = 128_256


def load_tokenizer(path: str | Path, override: str | Path | None = None) -> Tokenizer | HFTokenizer:
    """The tokenizer for a checkpoint folder (or a file in it), or for `override` when given.

    Looks for tokenizer.model (Llama 3) in the folder and in original/, then tokenizer.json. A folder with
    neither gets the Llama 3 tokenizer.model shipped in the llama-models package, which every Llama 3.x
    checkpoint uses, unless its config.json or params.json says the vocabulary is another size.
    """
    path = Path(override if override is not None else path)
    if path.is_file() and path.name == "tokenizer.json":
        return HFTokenizer(path.parent)
    if path.is_file() and path.suffix == ".model":
        return Tokenizer(path)
    folder = path.parent if path.is_file() else path
    if not folder.is_dir():
        raise TokenizerError(f"{path}: no such file or folder")
    found = tokenizer_file(folder)
    if found is not None:
        return HFTokenizer(folder) if found.name == "tokenizer.json" else Tokenizer(found)
    if override is not None:
        raise TokenizerError(f"{folder}: expected tokenizer.model or tokenizer.json, found neither")
    for name in ("config.json", "params.json"):
        vocab_size = read_json(folder / name).get("vocab_size")
        if vocab_size is not None and vocab_size != LLAMA3_VOCAB_SIZE:
            raise TokenizerError(f"{folder}: found no tokenizer.model or tokenizer.json, and {name} has "
                                 f"vocab_size={vocab_size}, so it is not Llama 3 ({LLAMA3_VOCAB_SIZE})")
    shipped = meta_tokenizer_model()
    if shipped is None:
        raise TokenizerError(f"{folder}: found no tokenizer.model (also in original/) or tokenizer.json, "
                             f"and no llama-models package with a Llama 3 tokenizer.model to fall back on")
    return Tokenizer(shipped)


def meta_tokenizer_model() -> Path | None:
    """llama_models/llama3/tokenizer.model from the llama-models package, found without importing it."""
    spec = importlib.util.find_spec("llama_models")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "llama3" / "tokenizer.model"
        if path.is_file():
            return path
    return None
