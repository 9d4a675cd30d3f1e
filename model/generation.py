"""Prefill + decode with a per-request KV cache and cancellation; the decoding rules are model/decoding.py's."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from .checkpoint import Checkpoint
from .config import DEFAULT_MAX_CONTEXT
from .context import PromptTooLong
from .decoding import Decoding, Logprob
from .kv_cache import PREFILL_CHUNK, KVCache
from .linear import MAX_KERNEL_ROWS
from .sampling import Sampler, SamplingParams
from .speculation import Draft, PromptLookup, Speculation, check, same_tokenizer, step_times
from .static_decode import new_cache
from .stats import Stats
from .tools import ToolCall, read_tools



class Generation:
    """One reply. Iterate it for text pieces; afterwards read `text`, `tokens`, `finish_reason`, `stats`
    (and `logprobs`, `tool_calls` where asked for).

    The decoding rules (stop ids and strings, the constraint, the token limit, logprobs, tool calls) are
    model/decoding.py's, as the engine's. finish_reason: "stop" (a stop token, a stop string, or a
    `constraint` after which only a stop token may come), "length" (max_new_tokens or the context
    limit), "cancelled" (should_stop() returned True, or the caller stopped reading), "constraint_failed"
    (the constraint's grammar engine failed midway; `error` says how).

    Sampling comes from `sampling` or from the shorthand `temperature`, `top_k`, `top_p` (not both);
    `seed`, when given, replaces the seed of either. Neither given: greedy. `stop`: strings that end the
    reply, never part of its text. `logprobs`: report each token's log-probability and this many
    alternatives. `tools`: the OpenAI tool definitions the prompt offers; a reply that calls one gives
    `tool_calls` (and its text is the content around the calls). `speculate`: how decode steps guess
    tokens ahead (model/speculation.py): "auto" from the prompt and the reply (prompt lookup), "off",
    or a smaller Checkpoint with the same tokenizer to draft them; the reply is the same either way.
    """

    def __init__(self, checkpoint: Checkpoint, prompt_ids: list[int], *, max_new_tokens: int = 512,
                 sampling: SamplingParams | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, should_stop: Callable[[], bool] | None = None,
                 max_context: int | None = None, kv_cache: KVCache | None = None,
                 stop_ids: set[int] | None = None, stop: str | Sequence[str] = (), constraint=None,
                 logprobs: int | None = None, tools: list[dict] | None = None, parallel_tool_calls: bool = True,
                 speculate: str | Checkpoint = "auto"):
        limit = min(max_context or DEFAULT_MAX_CONTEXT, checkpoint.config.max_seq_len)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= limit:
            raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; the context limit is {limit} "
                                f"tokens, which must also leave room for the reply")
        self.checkpoint, self.prompt_ids = checkpoint, list(prompt_ids)
        self.sampling = sampling_params(sampling, temperature, top_k, top_p, seed)
        self.should_stop = should_stop or (lambda: False)
        self.decoding = Decoding(
            checkpoint.tokenizer, self.prompt_ids, sampling=self.sampling, max_new_tokens=max_new_tokens,
            context_limit=limit, stop_ids=checkpoint.stop_ids if stop_ids is None else stop_ids, stop=stop,
            constraint=constraint, logprobs=logprobs, tools=[tool.name for tool in read_tools(tools)],
            parallel_tool_calls=parallel_tool_calls, device=checkpoint.device)
        needed = len(prompt_ids) + self.max_new_tokens
        if kv_cache is None:
            kv_cache = new_cache(checkpoint.model, needed, device=checkpoint.device, dtype=checkpoint.dtype)
        elif kv_cache.max_len < needed:
            kv_cache = kv_cache.resized(needed)
        self.kv_cache = kv_cache
        self._model = checkpoint.model
        self.speculation = speculation(checkpoint, speculate, needed)

    def __iter__(self) -> Iterator[str]:
        decoding, cache = self.decoding, self.kv_cache
        decoding.started = time.perf_counter()
        try:
            # Keys/values of a common prefix computed as this prompt's prefill would are kept
            # (model/kv_cache.py); at least the last prompt token is run for logits.
            reused = cache.reusable(self.prompt_ids)
            self.stats.reused_tokens = reused
            cache.truncate(reused)
            while cache.length < len(self.prompt_ids):
                if self.should_stop():
                    return
                start = cache.length
                chunk = self.prompt_ids[start:cache.chunk_end(len(self.prompt_ids))]
                logits = self._prefill(chunk, start)
                cache.extend(chunk)
            if self._pipelines():
                yield from self._pipelined(logits)
                return
            rows, inputs, guesses = logits[None], [], []  # the prompt's last row: no guesses
            while not decoding.finished and not self.should_stop():
                taken = 0
                for token, piece in check(decoding, rows, guesses):
                    taken += 1
                    if piece:
                        yield piece
                if inputs:  # a decode step: [last] + guesses ran; [last] + the guesses that stood are kept
                    cache.extend(inputs[:taken])
                    self.stats.step(len(guesses), taken)
                    if self.speculation is not None:
                        self.speculation.checked(len(guesses), taken - 1)
                if decoding.finished:
                    break
                guesses = self._guesses()
                inputs = [token, *guesses]
                rows = self._decode(inputs)
            piece = decoding.end()
            if piece:
                yield piece
        finally:  # also when the caller stops reading: the reply ends there, "cancelled"
            decoding.end()

    def _pipelines(self) -> bool:
        """Whether decode steps are queued a token ahead (`_pipelined`): a cache in a static slot (a GPU's CUDA
        graphs), no speculation (its guesses need the last token on the host), a reply draw() may sample."""
        return self.kv_cache.slot is not None and self.speculation is None and self.decoding.drawable

    def _pipelined(self, logits: torch.Tensor) -> Iterator[str]:
        """Decode with each step queued on the token sampled on the device before the host reads that token:
        the host detokenizes and checks token t while the GPU runs the step after it (gpt-fast's loop has no
        `.item()` at all; here the token comes back through pinned memory, waited for alone). A step after the
        reply's last token runs for nothing. The tokens, the cache and the stats are plain decoding's."""
        decoding, cache, model = self.decoding, self.kv_cache, self._model
        gpu = logits.device.type == "cuda"
        host = torch.empty(1, dtype=torch.long, pin_memory=gpu)  # where each token comes back
        ready = torch.cuda.Event() if gpu else None
        first = True
        while not decoding.finished and not self.should_stop():
            token = decoding.draw(logits).view(1)  # on the device
            host.copy_(token, non_blocking=gpu)
            if gpu:
                ready.record()
            position = cache.length
            ahead = len(decoding.tokens) + 1 < decoding.max_new_tokens and position + 1 < cache.max_len
            if ahead:  # the next step, queued before the token is read
                with torch.inference_mode():
                    logits = model.decode(token, [cache], positions=[position])[0]
            if gpu:
                ready.synchronize()
            sampled = int(host[0])
            piece = decoding.accept(sampled)
            if not first:
                self.stats.step(0, 1)
            first = False
            if piece:
                yield piece
            if decoding.finished or not ahead:
                break
            cache.extend([sampled])  # its step ran: its key and value are in
        piece = decoding.end()
        if piece:
            yield piece

    @property
    def max_new_tokens(self) -> int:
        """The longest reply: max_new_tokens, or less where the context limit comes first."""
        return self.decoding.max_new_tokens

    @property
    def tokens(self) -> list[int]:
        return self.decoding.tokens

    @property
    def text(self) -> str:
        return self.decoding.text

    @property
    def finish_reason(self) -> str | None:
        return self.decoding.finish_reason

    @property
    def error(self) -> str:
        return self.decoding.error

    @property
    def stats(self) -> Stats:
        return self.decoding.stats

    @property
    def sampler(self) -> Sampler:
        return self.decoding.sampler

    @property
    def logprobs(self) -> list[Logprob]:
        return self.decoding.logprobs

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.decoding.tool_calls

    @torch.inference_mode()
    def _prefill(self, ids: list[int], start_pos: int) -> torch.Tensor:
        """A prompt chunk at start_pos through the model, filling the cache; logits of its last token
        (vocab,). Always the forward pass, also for one token: a chunk is computed one way only."""
        tokens = torch.tensor([ids], dtype=torch.long, device=self.checkpoint.device)
        return self._model(tokens, start_pos=start_pos, kv_cache=self.kv_cache, last_only=True)[0, -1]

    def _guesses(self) -> list[int]:
        """Tokens guessed to follow the last sampled one, as many as the step, the cache and the token
        limit have room for."""
        if self.speculation is None:
            return []
        decoding, cache = self.decoding, self.kv_cache
        room = min(MAX_KERNEL_ROWS - 1, cache.max_len - cache.length - 1,
                   decoding.max_new_tokens - len(decoding.tokens) - 1)
        return self.speculation.guesses(lambda: self.prompt_ids + decoding.tokens, room)

    @torch.inference_mode()
    def _decode(self, inputs: list[int]) -> torch.Tensor:
        """The last sampled token and the guesses after it, at the cache's length on, through the model;
        the logits of each (len(inputs), vocab)."""
        tokens = torch.tensor(inputs, dtype=torch.long, device=self.checkpoint.device)
        start, started = self.kv_cache.length, time.perf_counter()
        logits = self._model.decode(tokens, [self.kv_cache] * len(inputs),
                                    positions=list(range(start, start + len(inputs))))
        if self.speculation is not None:
            self.speculation.times.observe(len(inputs), time.perf_counter() - started)
        return logits


def speculation(checkpoint: Checkpoint, speculate, max_len: int) -> Speculation | None:
    """The Speculation `speculate` asks for ("auto", "off" or a draft Checkpoint) for a reply whose
    cache holds max_len positions."""
    if isinstance(speculate, Checkpoint):
        why = same_tokenizer(checkpoint.tokenizer, speculate.tokenizer)
        if why is not None:
            raise ValueError(f"{speculate.name} cannot draft for {checkpoint.name}: {why}")
        return Speculation(Draft(speculate, max_len), step_times(checkpoint.model))
    if speculate == "auto":
        return Speculation(PromptLookup(), step_times(checkpoint.model))
    if speculate == "off":
        return None
    raise ValueError(f"speculate={speculate!r}: expected 'auto', 'off' or a draft Checkpoint")


def sampling_params(sampling: SamplingParams | None, temperature: float | None, top_k: int | None,
                    top_p: float | None, seed: int | None) -> SamplingParams:
    """One SamplingParams from Generation's `sampling` or its shorthand keywords."""
    shorthand = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                 if v is not None}
    if sampling is not None and shorthand:
        raise ValueError(f"Generation: pass either sampling= or {', '.join(shorthand)}=, not both")
    if sampling is None:
        sampling = SamplingParams(**{**shorthand, "top_k": shorthand.get("top_k") or 0})
    return sampling if seed is None else replace(sampling, seed=seed)


LLAMA3_TEMPERATURE, LLAMA3_TOP_P = 0.6, 0.9  # Meta's generation_config.json for Llama 3.x Instruct


def sampling_defaults(checkpoint: Checkpoint) -> SamplingParams:
    """The checkpoint's generation_config.json (Hugging Face names), else Llama 3's defaults.

    Reads temperature, top_k, top_p, min_p, repetition_penalty; do_sample=false means greedy.
    """
    g = checkpoint.generation_defaults

    def value(name: str, default, kind=float):
        found = g.get(name)
        if found is None:
            return default
        try:
            return kind(found)
        except (TypeError, ValueError):
            raise ValueError(f"{name}={found!r}: expected a {kind.__name__}") from None

    try:
        if g.get("do_sample") is False:  # greedy: only the penalty still matters
            return SamplingParams(repetition_penalty=value("repetition_penalty", 1.0))
        return SamplingParams(
            temperature=value("temperature", LLAMA3_TEMPERATURE), top_k=value("top_k", 0, int),
            top_p=value("top_p", LLAMA3_TOP_P), min_p=value("min_p", 0.0),
            repetition_penalty=value("repetition_penalty", 1.0))
    except ValueError as e:
        raise ValueError(f"generation_config.json of {checkpoint.name}: {e}") from None


def generate(checkpoint: Checkpoint, prompt_ids: list[int], **options) -> Generation:
    """Start a reply to prompt_ids; see Generation for the options and the results."""
    return Generation(checkpoint, prompt_ids, **options)
