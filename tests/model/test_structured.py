"""JSON replies by constrained decoding (model/structured.py) and the token bytes it reads from our tokenizers."""

import json
import random
import re

import jsonschema
import pytest
import torch
from support.checkpoints import write_tiny_checkpoint
from support.special_checkpoints import default_model

from model.checkpoint import load_checkpoint
from model.generation import generate, sampling_defaults
from model.sampling import SamplingParams
from model.decoding import ConstraintFailed
from model.structured import JsonConstraint, SchemaError, compiled_format
from model.tokenizer import HFTokenizer, Tokenizer, TokenizerError, meta_tokenizer_model

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}
# Every document of SMALL is short whatever the choices: random walks through its masks always end.
SMALL = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": -5, "maximum": 999},
    "r": {"enum": ["red", "green"]},
    "s": {"type": "string", "maxLength": 6},
    "ok": {"type": "boolean"},
    "xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
    "required": ["n", "r", "ok"], "additionalProperties": False}
SYSTEM = {"role": "system", "content": "Reply with one JSON object only."}


@pytest.fixture(scope="module")
def smollm2():
    return load_checkpoint(default_model())


@pytest.fixture(scope="module")
def llama3_tokenizer():
    return Tokenizer(meta_tokenizer_model())


def constrained_reply(checkpoint, question, schema=None, **options):
    prompt = checkpoint.chat_format.encode_dialog([SYSTEM, {"role": "user", "content": question}])
    constraint = JsonConstraint(checkpoint.tokenizer, schema, vocab_size=checkpoint.config.vocab_size,
                                stop_ids=checkpoint.stop_ids)
    reply = generate(checkpoint, prompt, constraint=constraint, **options)
    return "".join(reply), reply, constraint


# ---- token bytes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("texts", [['{"a": [1, 2.5e-3]}', "naïve café 你好 👍🏽", "\n\t  x\r\n", "<|eot_id|> 1234567"]])
def test_token_bytes_spell_the_text_of_encoded_ids(smollm2, llama3_tokenizer, texts):
    for tokenizer in (smollm2.tokenizer, llama3_tokenizer):
        pieces = tokenizer.token_bytes()
        assert len(pieces) == tokenizer.vocab_size
        for text in texts:
            assert b"".join(pieces[i] for i in tokenizer.encode(text)) == text.encode()


def test_token_bytes_of_known_ids(smollm2, llama3_tokenizer):
    llama3 = llama3_tokenizer.token_bytes()
    assert (llama3[2028], llama3[374], llama3[271]) == (b"This", b" is", b"\n\n")
    assert llama3[128009] == b"<|eot_id|>" and llama3[128255] == b"<|reserved_special_token_245|>"
    smol = smollm2.tokenizer.token_bytes()
    assert smol[:3] == [b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>"]
    assert smol[smollm2.tokenizer.encode(" world")[0]] == b" world"


def sentencepiece_folder(folder, decoder, vocab=None):
    from tokenizers import Tokenizer as HFRust
    from tokenizers import decoders, models
    vocab = vocab or {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "<0xC3>": 4, "\u2581a": 5, "b": 6}
    rust = HFRust(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    rust.decoder = decoder(decoders)
    rust.add_special_tokens(["<s>", "</s>"])
    folder.mkdir()
    rust.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return HFTokenizer(folder)


def test_token_bytes_of_a_sentencepiece_vocabulary(tmp_path):
    tokenizer = sentencepiece_folder(tmp_path / "sp", lambda d: d.Sequence(
        [d.Replace("\u2581", " "), d.ByteFallback(), d.Fuse(), d.Strip(" ", 1, 0)]))
    assert tokenizer.token_bytes() == [b"<unk>", b"<s>", b"</s>", b"\n", b"\xc3", b" a", b"b"]


def test_token_bytes_of_an_unknown_decoder_is_a_clear_error(tmp_path):
    tokenizer = sentencepiece_folder(tmp_path / "wp", lambda d: d.WordPiece())
    with pytest.raises(TokenizerError, match=r"tokenizer.json: expected a ByteLevel.*found \['WordPiece'\]"):
        tokenizer.token_bytes()
    foreign = sentencepiece_folder(tmp_path / "bl", lambda d: d.ByteLevel(),
                                   {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "\u20acx": 4})
    with pytest.raises(TokenizerError, match="expected byte-level characters in the vocabulary, found '\u20ac'"):
        foreign.token_bytes()


# ---- the mask ---------------------------------------------------------------------------------------------

def walk(constraint, tokenizer, rng, max_steps=400):
    """Random allowed ids until a stop id is allowed and drawn; the text, and whether it stopped."""
    stops = set(constraint.stop_ids)
    ids = []
    for _ in range(max_steps):
        mask = constraint.mask()
        allowed = mask.nonzero().flatten().tolist()
        assert allowed, "the mask allows nothing"
        stop_mask = mask[sorted(stops)]
        assert stop_mask.all() if constraint.complete else not stop_mask.any()  # stop ids exactly when complete
        token = rng.choice(allowed)
        if constraint.complete and rng.random() < 0.5:
            token = rng.choice(sorted(stops))
        constraint.advance(token)
        if token in stops:
            return tokenizer.decode(ids), True
        ids.append(token)
    return tokenizer.decode(ids), False


@pytest.mark.parametrize("which", ["smollm2", "llama3"])
def test_random_allowed_tokens_always_give_documents_of_the_schema(smollm2, llama3_tokenizer, which):
    tokenizer = smollm2.tokenizer if which == "smollm2" else llama3_tokenizer
    rng = random.Random(0)
    for _ in range(8):
        text, stopped = walk(JsonConstraint(tokenizer, SMALL), tokenizer, rng)
        assert stopped, f"a walk did not end: {text!r}"
        jsonschema.validate(json.loads(text), SMALL)


def test_random_walks_in_any_object_mode_stay_a_json_prefix(smollm2):
    """Any-object documents can be endless, so each walk ends its own way: after 30 random ids, the
    allowed id that closes most (a quote, then brackets) until a stop id is allowed."""
    tokenizer = smollm2.tokenizer
    pieces = tokenizer.token_bytes()
    closing = [tokenizer.encode(s)[0] for s in ('"', "}", "]", "0", "null", ",")]
    rng = random.Random(1)
    for _ in range(6):
        constraint, ids = JsonConstraint(tokenizer, None), []
        while not constraint.complete:
            allowed = constraint.mask().nonzero().flatten().tolist()
            token = rng.choice(allowed) if len(ids) < 30 else next(
                (t for t in closing if t in set(allowed)), rng.choice(allowed))
            constraint.advance(token)
            ids.append(token)
            assert len(ids) < 600, tokenizer.decode(ids)
        document = json.loads(b"".join(pieces[i] for i in ids).decode())
        assert isinstance(document, dict)


def test_a_token_the_mask_refuses_raises_and_changes_nothing(smollm2):
    tokenizer = smollm2.tokenizer
    constraint = JsonConstraint(tokenizer, PERSON)
    for token in tokenizer.encode('{"name": "Ada", "age": 3'):
        constraint.advance(token)
    before = constraint.mask()
    refused = (~before).nonzero().flatten().tolist()
    for token in random.Random(2).sample(refused, 20) + [tokenizer.eos_id, -1, before.numel()]:
        with pytest.raises(ValueError, match=f"token {token} does not continue the JSON reply"):
            constraint.advance(token)
    assert torch.equal(constraint.mask(), before)
    for token in tokenizer.encode('6, "role": "guest", "tags": []}'):
        constraint.advance(token)
    assert constraint.complete and constraint.finished


def test_stop_ids_only_once_complete_and_alone_once_finished(smollm2):
    tokenizer = smollm2.tokenizer
    constraint = JsonConstraint(tokenizer, {"type": "integer"}, stop_ids={2, 0})
    assert not constraint.mask()[[0, 2]].any()
    constraint.advance(tokenizer.encode("7")[0])
    mask = constraint.mask()
    assert constraint.complete and not constraint.finished  # 7 is whole, 75 would be too
    assert mask[[0, 2]].all() and mask[tokenizer.encode("5")[0]]
    constraint.advance(2)
    assert constraint.finished and constraint.mask().nonzero().flatten().tolist() == [0, 2]

    closed = JsonConstraint(tokenizer, None)
    for token in tokenizer.encode('{"a": 1}'):
        closed.advance(token)
    assert closed.finished and closed.mask().nonzero().flatten().tolist() == sorted(tokenizer.stop_ids)


def test_model_vocabulary_larger_than_the_tokenizer_never_allows_the_extra_ids(smollm2):
    tokenizer = smollm2.tokenizer
    constraint = JsonConstraint(tokenizer, {"type": "string"}, vocab_size=tokenizer.vocab_size + 64)
    constraint.advance(tokenizer.encode('"')[0])
    mask = constraint.mask()
    assert mask.shape == (tokenizer.vocab_size + 64,) and mask.dtype == torch.bool
    assert mask[:tokenizer.vocab_size].sum() > 10_000 and not mask[tokenizer.vocab_size:].any()
    with pytest.raises(ValueError, match="vocab_size=100: expected at least the tokenizer's 49152 ids"):
        JsonConstraint(tokenizer, None, vocab_size=100)


def test_each_schema_compiles_once_and_each_reply_has_its_own_state(smollm2):
    tokenizer = smollm2.tokenizer
    schema = {"type": "object", "properties": {"cache_test": {"type": "integer"}}}
    before = compiled_format.cache_info()
    first = JsonConstraint(tokenizer, schema)
    second = JsonConstraint(tokenizer, json.loads(json.dumps(schema)))  # equal, not the same object
    after = compiled_format.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    start = second.mask()
    first.advance(tokenizer.encode("{")[0])
    assert torch.equal(second.mask(), start) and not torch.equal(first.mask(), start)


@pytest.mark.parametrize("schema, message", [
    ({"type": "foo"}, r"response_format: the JSON schema is not supported \(Invalid type: foo\)"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}, r"Pointer '/\$defs/x' does not exist"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, r"minLength \(5\) is greater than maxLength \(2\)"),
    ({"type": "string", "format": "no-such-format"}, r"Unknown format: no-such-format"),
    ([{"type": "object"}], r"response_format: expected a JSON schema object, found list"),
    ({"type": "object", "default": {1, 2}}, r"response_format: the JSON schema is not JSON \(Object of type set"),
])
def test_a_bad_schema_is_a_value_error_that_says_what_is_wrong(smollm2, schema, message):
    with pytest.raises(SchemaError, match=message) as caught:
        JsonConstraint(smollm2.tokenizer, schema)
    assert isinstance(caught.value, ValueError)


def optional_properties(n: int, first: int = 0) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(first, first + n)}}


def nested(levels: int, kind: str = "array") -> dict:
    schema = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema} if kind == "array" else {"anyOf": [schema, {"type": "null"}]}
    return schema


SLOW_PATTERN = "^(x{1000}){1000}$"  # a lexer of a million states: llguidance gives up building it
# Each compiles, and failed at the reply's first token (the first two) or at its first "{" or '"' before
# the limits and the opening masks (an HTTP 500, or a 4 s stall of every stream for the last).
@pytest.mark.parametrize("schema, message", [
    ({"$ref": "#"}, r"not supported \(at the document's start: NoExtensionBias\)$"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, r"NoExtensionBias"),
    (optional_properties(499), r"schema's 'properties' has 499 properties; at most 256 are taken$"),
    ({"type": "object", "properties": {"inner": optional_properties(300)}},
     r"schema's 'properties.inner.properties' has 300 properties; at most 256 are taken$"),
    ({"anyOf": [optional_properties(250), optional_properties(250, 1000)]},
     r"after the document's first '\{': Parser Error: Current row has 2014 items; max is 2000\)$"),
    ({"anyOf": [{"const": i} for i in range(1001)]}, r"'anyOf' has 1,001 schemas; at most 1,000 are taken$"),
    ({"type": "object", "properties": {"default": {"enum": list(range(1001))}}},  # a property, not a keyword
     r"'properties.default.enum' has 1,001 values; at most 1,000 are taken$"),
    ({"type": "string", "pattern": "a" * 1001}, r"a pattern in the JSON schema's '\(top\)' has 1,001 characters"),
    ({"type": "string", "pattern": SLOW_PATTERN}, r"after the document's first '\"': lexer error: too many expressions"),
    (nested(64), r"nests deeper than 64 levels \(at 'items(\.items)+'\)$"),
    ({"enum": ["x" * 1000] * 101}, r"the JSON schema is 101,414 bytes of JSON; at most 100,000 are taken$"),
])
def test_a_schema_that_would_fail_in_the_reply_is_refused_before_it(smollm2, schema, message):
    with pytest.raises(SchemaError, match="^response_format: .*" + message):
        JsonConstraint(smollm2.tokenizer, schema)


def test_what_the_limits_leave_is_served(smollm2):
    """Past each limit a schema is refused; at it, replies of it run (llguidance takes about twice as much)."""
    tokenizer = smollm2.tokenizer
    for schema in [optional_properties(256), {"anyOf": [{"const": i} for i in range(1000)]}, nested(31),
                   {"enum": [f"value {i}" for i in range(1000)]}, {"type": "string", "pattern": "a" * 1000},
                   {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}]:
        walk(JsonConstraint(tokenizer, schema), tokenizer, random.Random(2), max_steps=40)  # no ConstraintFailed


def test_a_constraint_that_fails_midway_ends_its_reply_with_what_it_wrote(smollm2):
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": SLOW_PATTERN}},
              "required": ["code"], "additionalProperties": False}
    text, reply, constraint = constrained_reply(smollm2, "Give me a code.", schema, max_new_tokens=20)
    assert reply.finish_reason == "constraint_failed" and text == reply.text
    assert re.fullmatch(r'\{\s*"code"\s*:\s*"', text), text  # up to the string whose lexer failed
    assert re.fullmatch(r"response_format: the JSON schema could not be followed after \d+ tokens of the reply "
                        r"\(lexer error: too many expressions constructed\): simplify it .*", reply.error), reply.error
    with pytest.raises(ConstraintFailed):  # and the constraint stays failed
        constraint.mask()
    # llguidance's copies of a compiled schema share its lexer, which the failure broke: the next reply of the
    # schema is refused before it starts (it refused the next reply's first tokens, or its mask allowed none)
    with pytest.raises(SchemaError, match=r"^response_format: the JSON schema is not supported \(an earlier reply "
                                          r"of it failed: lexer error: too many expressions constructed\)$"):
        JsonConstraint(smollm2.tokenizer, schema)


# ---- replies of the default model -------------------------------------------------------------------------

QUESTIONS = ["What is the capital of France? Answer in JSON.", "Hello! How are you today?",
             "List three fruits with their colors as JSON.", "Describe the planet Mars in JSON with its name and diameter.",
             "Give me a JSON object with a title and an author of a famous book."]


def test_without_the_constraint_the_model_does_not_answer_json(smollm2):
    """So the tests below see the constraint at work, not a model that writes JSON anyway."""
    prompt = smollm2.chat_format.encode_dialog([SYSTEM, {"role": "user", "content": QUESTIONS[1]}])
    text = "".join(generate(smollm2, prompt, max_new_tokens=40))
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_json_mode_greedy_replies_parse(smollm2):
    # Greedy as an API client with temperature 0 gets it: the model's default repetition penalty still applies
    # (without it, greedy decoding of the 135M model repeats a key until the token limit).
    greedy = SamplingParams(repetition_penalty=sampling_defaults(smollm2).repetition_penalty)
    assert greedy.repetition_penalty > 1
    for question in QUESTIONS:
        text, reply, constraint = constrained_reply(smollm2, question, max_new_tokens=256, sampling=greedy)
        assert reply.finish_reason == "stop" and constraint.complete, (question, text)
        assert isinstance(json.loads(text), dict), (question, text)


def test_json_mode_sampled_replies_parse(smollm2):
    finished = 0
    for question in QUESTIONS[:3]:
        for seed in (1, 2):
            text, reply, _ = constrained_reply(smollm2, question, max_new_tokens=256, temperature=0.7, top_p=0.9,
                                               seed=seed)
            if reply.finish_reason == "stop":
                finished += 1
                assert isinstance(json.loads(text), dict), (question, seed, text)
    # A sampled reply may ramble to the token limit: 25 of 30 finished (5 questions, seeds 1-6), before and after
    # a change to the attention's rounding; with 5 of 6 asked here, which 6 finish was down to that rounding.
    assert finished >= 3


@pytest.mark.parametrize("options", [{}, {"temperature": 0.7, "top_p": 0.9, "seed": 3}])
def test_json_schema_replies_validate(smollm2, options):
    for question in ("Invent a user of a web site.", "Describe a person named Ada, aged 36."):
        text, reply, _ = constrained_reply(smollm2, question, PERSON, max_new_tokens=400, **options)
        assert reply.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_llama3_tokenizer_path_on_a_tiny_random_checkpoint(tmp_path):
    checkpoint = load_checkpoint(write_tiny_checkpoint(tmp_path / "tiny"))
    assert isinstance(checkpoint.tokenizer, Tokenizer)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "r": {"enum": ["red", "green"]}},
              "required": ["ok", "r"], "additionalProperties": False}
    prompt = checkpoint.chat_format.encode_dialog([{"role": "user", "content": "Say yes in JSON."}])
    for options in ({}, {"temperature": 1.0, "seed": 5}):
        constraint = JsonConstraint(checkpoint.tokenizer, schema, vocab_size=checkpoint.config.vocab_size,
                                    stop_ids=checkpoint.stop_ids)
        reply = generate(checkpoint, prompt, max_new_tokens=300, constraint=constraint, **options)
        text = "".join(reply)
        assert reply.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
