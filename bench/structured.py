"""What JSON constraints cost: our JsonConstraint against a decode step, and the candidate libraries.

    python bench/structured.py             # JsonConstraint per token against a decode step of the default model
    python bench/structured.py --compare   # llguidance, xgrammar, outlines-core (those installed), both vocabularies

--compare runs each (library, vocabulary) in a fresh process: the time to import it, to build its view of
the vocabulary, to compile any-object and a schema, the time per token to compute the allowed-token mask
along a fixed document, the resident memory it added, which schema keywords it enforces, and what it says
about bad schemas. Results: docs/structured.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, memory_mb, run_worker, wait_for_idle, write_result  # noqa: E402

from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR  # noqa: E402
from model.tokenizer import HFTokenizer, Tokenizer, meta_tokenizer_model  # noqa: E402

DEFAULT_MODEL = DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME
LIBRARIES = ("llguidance", "xgrammar", "outlines_core")
VOCABULARIES = ("smollm2", "llama3")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "height": {"type": "number"},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
    "required": ["name", "age", "role"], "additionalProperties": False}
DOCUMENT = '{"name": "Ada Lovelace", "age": 36, "height": 1.65, "role": "admin", "tags": ["math", "poetry"]}'
# (keyword, schema, [(document, must it be accepted)]): enforced when every answer is right.
FEATURES = [
    ("minLength/maxLength", {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
                             "required": ["s"]}, [('{"s": "abc"}', True), ('{"s": "a"}', False), ('{"s": "abcde"}', False)]),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"]},
     [('{"a": 1, "b": 2}', True), ('{"a": 1}', True), ('{"b": 1}', False)]),
    ("additionalProperties", {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
     [('{"a": 1}', True), ('{"a": 1, "c": 3}', False)]),
    ("enum", {"type": "object", "properties": {"r": {"enum": ["x", "y"]}}, "required": ["r"]},
     [('{"r": "x"}', True), ('{"r": "z"}', False)]),
    ("integer minimum/maximum", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 150}},
                                 "required": ["n"]}, [('{"n": 36}', True), ('{"n": 200}', False), ('{"n": -1}', False),
                                                      ('{"n": 1.5}', False)]),
    ("number exclusiveMaximum", {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}},
                                 "required": ["x"]}, [('{"x": 0.5}', True), ('{"x": 1.5}', False)]),
    ("array minItems/maxItems", {"type": "object", "properties": {"t": {"type": "array", "items": {"type": "string"},
                                                                        "minItems": 1, "maxItems": 2}}, "required": ["t"]},
     [('{"t": ["a"]}', True), ('{"t": []}', False), ('{"t": ["a", "b", "c"]}', False), ('{"t": [1]}', False)]),
    ("pattern", {"type": "object", "properties": {"z": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["z"]},
     [('{"z": "12345"}', True), ('{"z": "1234a"}', False)]),
    ("format: date", {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]},
     [('{"d": "2024-01-31"}', True), ('{"d": "yesterday"}', False)]),
    ("$defs/$ref", {"type": "object", "$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                      "required": ["x"]}},
                    "properties": {"a": {"$ref": "#/$defs/p"}}, "required": ["a"]},
     [('{"a": {"x": 1}}', True), ('{"a": {"y": 1}}', False)]),
    ("anyOf", {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}, "required": ["v"]},
     [('{"v": null}', True), ('{"v": 3}', True), ('{"v": "s"}', False)]),
    ("any object", {"type": "object"}, [('{"a": [1, {"b": null}], "c": "d"}', True), ('[1]', False), ('{"a": }', False)]),
]
BAD_SCHEMAS = [("unknown type", {"type": "foo"}), ("missing $ref", {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}),
               ("minLength > maxLength", {"type": "string", "minLength": 5, "maxLength": 2})]


def load_vocabulary(name: str):
    return HFTokenizer(DEFAULT_MODEL) if name == "smollm2" else Tokenizer(meta_tokenizer_model())


# ---- the three libraries behind one small interface -----------------------------------------------------

class LLGuidance:
    def __init__(self, tokenizer, token_bytes):
        import llguidance

        from model.structured import LLVocabulary
        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(LLVocabulary(tokenizer)),
                                                eos_token=sorted(tokenizer.stop_ids))

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled, log_level=0)

    def mask(self, matcher):
        return matcher.compute_bitmask()

    def consume(self, matcher, ids):
        return matcher.try_consume_tokens(ids) == len(ids)

    def accepting(self, matcher):
        return matcher.is_accepting()


class XGrammar:
    def __init__(self, tokenizer, token_bytes):
        import xgrammar
        self.xgr = xgrammar
        special = set(tokenizer.special_tokens.values())  # xgrammar reads an empty token as a special one
        info = xgrammar.TokenizerInfo([b"" if i in special else b for i, b in enumerate(token_bytes)],
                                      xgrammar.VocabType.RAW, vocab_size=len(token_bytes),
                                      stop_token_ids=sorted(tokenizer.stop_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.bits = xgrammar.allocate_token_bitmask(1, len(token_bytes))

    def compile(self, schema):
        try:
            return self.compiler.compile_json_schema(json.dumps(schema))
        except RuntimeError as e:
            raise ValueError(str(e)) from None

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher):
        matcher.fill_next_token_bitmask(self.bits)
        return self.bits

    def consume(self, matcher, ids):
        return all(matcher.accept_token(i) for i in ids)

    def accepting(self, matcher):
        return matcher.is_completed()


class OutlinesCore:
    def __init__(self, tokenizer, token_bytes):
        import outlines_core
        import torch
        self.oc = outlines_core
        special = set(tokenizer.special_tokens.values())
        ids_of: dict[bytes, list[int]] = {}
        for i, piece in enumerate(token_bytes):
            if i not in special:
                ids_of.setdefault(piece, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_id, ids_of)
        self.bits = torch.zeros((len(token_bytes) + 31) // 32, dtype=torch.int32)

    def compile(self, schema):
        return self.oc.Index(self.oc.json_schema.build_regex_from_schema(json.dumps(schema)), self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def mask(self, matcher):
        matcher.write_mask_into(self.bits.data_ptr(), self.bits.numel(), 4)
        return self.bits

    def consume(self, matcher, ids):
        try:
            for i in ids:
                matcher.advance(i, return_tokens=False)
        except ValueError:
            return False
        return True

    def accepting(self, matcher):
        return matcher.is_finished()


ADAPTERS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines_core": OutlinesCore}


def compare_worker(spec: dict) -> dict:
    """One library on one vocabulary, in this fresh process."""
    tokenizer = load_vocabulary(spec["vocabulary"])
    token_bytes = tokenizer.token_bytes()
    rss_before = memory_mb()["rss"]
    start = time.perf_counter()
    __import__(spec["library"])
    import_s = time.perf_counter() - start
    start = time.perf_counter()
    library = ADAPTERS[spec["library"]](tokenizer, token_bytes)
    result = {"import_s": import_s, "vocabulary_s": time.perf_counter() - start, "vocab": len(token_bytes)}
    ids = tokenizer.encode(DOCUMENT)
    for name, schema in (("any_object", {"type": "object"}), ("schema", SCHEMA)):
        start = time.perf_counter()
        compiled = library.compile(schema)
        result[f"{name}_compile_ms"] = (time.perf_counter() - start) * 1e3
        matcher, times = library.matcher(compiled), []
        for token in ids:  # the mask of each position, then the document's own token
            start = time.perf_counter()
            library.mask(matcher)
            times.append((time.perf_counter() - start) * 1e3)
            assert library.consume(matcher, [token]), f"{spec['library']} refused the document at id {token}"
        assert library.accepting(matcher), f"{spec['library']} did not accept the whole document"
        result[f"{name}_mask_ms"] = {"mean": statistics.mean(times), "median": statistics.median(times),
                                     "max": max(times), "tokens": len(times)}
    result["rss_added_mb"] = memory_mb()["rss"] - rss_before
    result["features"] = {}
    for name, schema, cases in FEATURES:
        try:
            compiled = library.compile(schema)
        except ValueError as e:
            result["features"][name] = f"refused: {e}"
            continue
        wrong = []
        for text, wanted in cases:
            matcher = library.matcher(compiled)
            if (library.consume(matcher, tokenizer.encode(text)) and library.accepting(matcher)) != wanted:
                wrong.append(text)
        result["features"][name] = "enforced" if not wrong else f"wrong on {wrong}"
    result["bad_schemas"] = {}
    for name, schema in BAD_SCHEMAS:
        try:
            library.compile(schema)
            result["bad_schemas"][name] = "accepted"
        except ValueError as e:
            result["bad_schemas"][name] = str(e).strip()[:160]
    return result


def compare(idle_wait: float) -> None:
    print(json.dumps(machine()))
    for library in LIBRARIES:
        try:
            __import__(library)
        except ImportError:
            print(f"{library}: not installed, skipped")
            continue
        for vocabulary in VOCABULARIES:
            result = run_worker(Path(__file__), {"mode": "compare", "library": library, "vocabulary": vocabulary},
                                idle_wait=idle_wait)
            print(f"{library} {vocabulary}: {json.dumps(result)}", flush=True)


# ---- our JsonConstraint against a decode step ----------------------------------------------------------

def constraint_alone(vocabulary: str, repeats: int = 20) -> dict:
    """ms to build the first constraint of a vocabulary, one of a new schema and one of a cached schema; ms per
    token of mask() + advance() along DOCUMENT, without a model (median of `repeats` walks)."""
    from model.structured import JsonConstraint
    tokenizer = load_vocabulary(vocabulary)
    ids = tokenizer.encode(DOCUMENT)
    times = {}
    for name, schema in (("first_ms", None), ("new_schema_ms", SCHEMA), ("cached_schema_ms", SCHEMA)):
        start = time.perf_counter()
        JsonConstraint(tokenizer, schema)  # the first one also builds llguidance's view of the vocabulary
        times[name] = (time.perf_counter() - start) * 1e3
    walks = []
    for _ in range(repeats):
        constraint = JsonConstraint(tokenizer, SCHEMA)
        start = time.perf_counter()
        for token in ids:
            constraint.mask()
            constraint.advance(token)
        walks.append((time.perf_counter() - start) * 1e3 / len(ids))
    return {"ms_per_token": statistics.median(walks), "tokens": len(ids)} | times


class Timed:
    """A JsonConstraint whose mask() and advance() calls are timed."""

    def __init__(self, constraint):
        self.constraint, self.seconds = constraint, 0.0

    def mask(self):
        start = time.perf_counter()
        mask = self.constraint.mask()
        self.seconds += time.perf_counter() - start
        return mask

    def advance(self, token):
        start = time.perf_counter()
        self.constraint.advance(token)
        self.seconds += time.perf_counter() - start

    @property
    def finished(self):
        return self.constraint.finished


def in_generation(rounds: int) -> dict:
    """Greedy replies of the default model to one prompt, unconstrained (64 tokens, stop ids off) and in JSON
    mode, alternating: ms per token of each, and the constraint's own share."""
    from model import load_checkpoint
    from model.generation import generate
    from model.structured import JsonConstraint
    checkpoint = load_checkpoint(DEFAULT_MODEL)
    prompt = checkpoint.chat_format.encode_dialog([
        {"role": "system", "content": "Reply with one JSON object only."},
        {"role": "user", "content": "List three fruits with their colors as JSON."}])
    free, constrained, own = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        reply = generate(checkpoint, prompt, max_new_tokens=64, stop_ids=set())
        list(reply)
        free.append((time.perf_counter() - start - reply.stats.time_to_first_token) * 1e3 / (len(reply.tokens) - 1))
        timed = Timed(JsonConstraint(checkpoint.tokenizer, None, vocab_size=checkpoint.config.vocab_size,
                                     stop_ids=checkpoint.stop_ids))
        start = time.perf_counter()
        reply = generate(checkpoint, prompt, max_new_tokens=256, constraint=timed)
        text = "".join(reply)
        constrained.append((time.perf_counter() - start - reply.stats.time_to_first_token) * 1e3 / (len(reply.tokens) - 1))
        own.append(timed.seconds * 1e3 / len(reply.tokens))
        json.loads(text)  # the constrained reply is JSON, or this run is wrong
    return {"decode_ms_per_token": statistics.median(free), "json_decode_ms_per_token": statistics.median(constrained),
            "constraint_ms_per_token": statistics.median(own), "json_tokens": len(reply.tokens), "rounds": rounds}


def cost(rounds: int, idle_wait: float) -> None:
    import torch
    print(json.dumps(machine() | {"threads": torch.get_num_threads()}))
    if idle_wait:
        print(f"other load before: {wait_for_idle(idle_wait):.2f} cores")
    for vocabulary in VOCABULARIES:
        print(f"JsonConstraint alone, {vocabulary}: {json.dumps(constraint_alone(vocabulary))}")
    result = in_generation(rounds)
    print(f"default model, greedy: {json.dumps(result)}")
    print(f"constraint / decode step: {result['constraint_ms_per_token'] / result['decode_ms_per_token']:.3f}; "
          f"JSON-mode ms per token / free: {result['json_decode_ms_per_token'] / result['decode_ms_per_token']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", action="store_true", help="compare the constraint libraries that are installed")
    parser.add_argument("--rounds", type=int, default=3, help="alternating free / JSON-mode replies")
    parser.add_argument("--idle-wait", type=float, default=60.0, help="seconds to wait for other load to go quiet")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 is steadier on a busy machine)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    if args.worker:
        write_result(args.out, compare_worker(json.loads(args.worker)))
    elif args.compare:
        compare(args.idle_wait)
    else:
        cost(args.rounds, args.idle_wait)


if __name__ == "__main__":
    main()
