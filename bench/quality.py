"""How much int8 and int4 (and bf16) weights change the default model's answers.

    python bench/quality.py [--checkpoint weights/SmolLM2-135M-Instruct] [--text FILE] [--threads N]
    python bench/quality.py --served    # the default model as served against the same weights widened

For a fixed set of prompts: does greedy decoding give the same first 20 tokens as fp32 weights, and
as bf16 weights? And the perplexity of a fixed text under each variant. The default model's folder holds
its GGUF's blocks (Q4_1 matrices as int4 with the file's scales and minimums, the Q8_0 embedding and tied
head as int8): "fp32" and "bf16" are those weights widened at load (fp32: every value exact, fp32
arithmetic), "int8" and "int4" quantized again from them at load, "Q4_1 blocks" the file's own, as the
engine serves them on a CPU with the decode kernel (bf16 activations where the CPU has them).
--served: only fp32, bf16 and the Q4_1 blocks (with bf16 and with fp32 activations), on the longer text
of bench/perplexity.txt (1,406 tokens of stories, instructions, explanations, a letter, a dialogue, code).
Perplexity three times: the text in one forward pass (prefill, F.linear), a token
at a time through the decode step (the kernel, as for one reply alone: for int8 weights x rounded to
int16 per row, for int4 on AVX-512 to int8 per block of 32), and the same in a batch of 8 copies of the
text (as 8 streams are served: on CPUs with AMX, int8 weights then take the tiles, x rounded to int8
per group of 64). Prints a table.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import KVCache, generate, kernels, load_checkpoint  # noqa: E402
from model.cpu import model_name  # noqa: E402
from model.options import DEFAULT_MODEL_NAME, DEFAULT_WEIGHTS_DIR, ModelOptions  # noqa: E402

OPTIONS = ModelOptions.from_env()  # the decode kernel's options and the cache folder, as the app takes them

PROMPTS = [
    "What is the capital of France?", "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.", "What is 12 times 7?", "Name three primary colors.",
    "How do I reverse a list in Python?", "Who wrote Romeo and Juliet?",
    "Give me a tip for sleeping better.", "What is the boiling point of water in Fahrenheit?",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?", "What does a CPU do?",
    "Suggest a name for a pet turtle.", "What is the largest planet in our solar system?",
    "How many legs does a spider have?", "Summarize the plot of Cinderella in two sentences.",
    "What is the difference between weather and climate?", "List two uses of vinegar.",
    "What language is spoken in Brazil?", "Write a SQL query that counts rows in a table named users.",
]

TEXT = (
    "The river rose slowly through the night, and by morning the low fields near the village were "
    "under water. Farmers moved their animals to the hills, while children watched from the bridge "
    "as branches and barrels floated past. By noon the rain had stopped, the sun came out, and the "
    "water began to fall again, leaving a thin layer of mud over the roads. Within a week the fields "
    "were green, and the people of the village said that the flood had been good for the soil.\n\n"
    "To make a simple loaf of bread, mix four cups of flour with a teaspoon of salt and a packet of "
    "yeast, then add warm water until the dough holds together. Knead it for ten minutes, cover the "
    "bowl with a towel, and leave it somewhere warm for an hour. When it has doubled in size, shape it, "
    "let it rise once more, and bake it at two hundred degrees for about forty minutes.\n\n"
    "A computer keeps the programs it is running in memory, which is fast but forgets everything when "
    "the power goes off, and keeps files on a disk, which is slower but remembers. When you open a "
    "document, the operating system copies it from the disk into memory; when you save it, the changes "
    "are written back. This is why unsaved work is lost if the battery dies.\n\n"
    "\"Are you coming to the market tomorrow?\" asked Maria. \"I think so,\" said her brother, \"but "
    "only if the bus is running. Last week it broke down halfway and we had to walk the rest of the "
    "way.\" Maria laughed and promised to bring an umbrella, just in case it rained again.\n\n"
    "In the early years of the railway, each town kept its own time by the sun, so clocks in two "
    "cities a few hundred miles apart could differ by several minutes. Timetables became so confusing "
    "that the railway companies agreed on a standard time, and within a few decades most countries had "
    "divided the world into time zones."
)


LONG_TEXT = Path(__file__).with_name("perplexity.txt")

VARIANTS = {  # name -> load_checkpoint's keywords
    "fp32": dict(dtype=torch.float32, widen=True),
    "bf16": dict(dtype=torch.bfloat16, widen=True),
    "int8": dict(dtype=torch.bfloat16, quantize="int8", widen=True),
    "int4": dict(dtype=torch.bfloat16, quantize="int4", widen=True),
    "Q4_1 blocks (as served)": dict(widen="auto"),  # as app/engine/core.py loads the default model
    "Q4_1 blocks, fp32 activations": dict(dtype=torch.float32),
}
ALL = ["fp32", "bf16", "int8", "int4", "Q4_1 blocks (as served)"]
SERVED = ["fp32", "bf16", "Q4_1 blocks (as served)", "Q4_1 blocks, fp32 activations"]


def greedy(ckpt, prompt: str, n: int = 20) -> list[int]:
    ids = ckpt.chat_format.encode_dialog([{"role": "user", "content": prompt}])
    gen = generate(ckpt, ids, max_new_tokens=n, temperature=0.0, stop_ids=set())
    list(gen)
    return gen.tokens


@torch.inference_mode()
def perplexity(ckpt, text: str, batch: int = 8) -> tuple[float, float, float]:
    """The text's perplexity with all of it in one forward pass (prefill: F.linear), fed a token at a time
    through the decode step (the kernel, as one reply is generated), and likewise as the first of `batch`
    copies decoded together (as that many streams are)."""
    ids = ckpt.tokenizer.encode(text)
    targets = torch.tensor(ids[1:])
    prefill = ckpt.model(torch.tensor([ids]))[0, :-1].float()

    def decoded(copies: int) -> torch.Tensor:  # logits (len(ids) - 1, vocab) of the first copy
        caches = [KVCache(ckpt.config, len(ids), dtype=ckpt.model.compute_dtype) for _ in range(copies)]
        first = [ckpt.model(torch.tensor([ids[:1]]), 0, cache)[0, -1].float() for cache in caches][0]
        for cache in caches:
            cache.tokens = ids[:1]
        steps = [first]
        for token in ids[1:-1]:
            steps.append(ckpt.model.decode(torch.tensor([token] * copies), caches)[0].float())
            for cache in caches:
                cache.tokens.append(token)
        return torch.stack(steps)

    return tuple(math.exp(torch.nn.functional.cross_entropy(logits, targets).item())
                 for logits in (prefill, decoded(1), decoded(batch)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(DEFAULT_WEIGHTS_DIR / DEFAULT_MODEL_NAME))
    p.add_argument("--served", action="store_true",
                   help="the default model as served against the same weights widened to fp32 and bf16")
    p.add_argument("--text", type=Path, help=f"the text whose perplexity to measure (default: a built-in "
                   f"398-token one; with --served, {LONG_TEXT.name})")
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels.configure(**OPTIONS.kernel_options)
    text_file = args.text or (LONG_TEXT if args.served else None)
    text = text_file.read_text(encoding="utf-8") if text_file else TEXT
    results, n_tokens = {}, 0
    for name in SERVED if args.served else ALL:
        ckpt = load_checkpoint(args.checkpoint, **VARIANTS[name])
        if "Q4_1" in name and ckpt.model.layers[0].attention.wq.scale is None:
            print(f"{name}: skipped, {args.checkpoint} holds no quantized weights", file=sys.stderr)
            continue
        n_tokens = len(ckpt.tokenizer.encode(text))
        results[name] = ([greedy(ckpt, q, args.tokens) for q in PROMPTS], perplexity(ckpt, text))
        print(f"{name}: perplexity {results[name][1][0]:.3f}", file=sys.stderr, flush=True)
        del ckpt
    print(f"{args.checkpoint}: {len(PROMPTS)} prompts, greedy, first {args.tokens} tokens; perplexity of "
          f"{text_file or 'the built-in text'} ({n_tokens} tokens); {model_name()}, {args.threads} threads, "
          f"decode kernel {kernels.decode_path()}\n")
    print("| weights | same first tokens as fp32 | as bf16 | mean tokens before the first difference from bf16 "
          "| perplexity | vs fp32 | vs bf16 | decode perplexity | vs fp32 | vs bf16 "
          "| decode in a batch of 8 | vs fp32 | vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    fp32, bf16 = results["fp32"], results["bf16"]
    for name, (tokens, ppl) in results.items():
        row = f"| {name} | {same(tokens, fp32[0])}/{len(PROMPTS)} | {same(tokens, bf16[0])}/{len(PROMPTS)} | " \
              f"{agreeing(tokens, bf16[0]):.1f} |"
        for i in range(3):  # prefill, decode, decode in a batch
            vs_fp32, vs_bf16 = ppl[i] / fp32[1][i] - 1, ppl[i] / bf16[1][i] - 1
            row += f" {ppl[i]:.3f} | {vs_fp32 * 100:+.2f}% | {vs_bf16 * 100:+.2f}% |"
        print(row)


def same(tokens: list[list[int]], reference: list[list[int]]) -> int:
    """Prompts whose greedy tokens are all equal."""
    return sum(a == b for a, b in zip(tokens, reference))


def agreeing(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Mean count of leading tokens equal to the reference's."""
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(tokens, reference)]
    return sum(prefix) / len(prefix)

if __name__ == "__main__":
    main()
