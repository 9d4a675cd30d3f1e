"""Choosing the next token from logits: penalties, top-k, top-p, min-p, temperature, a seeded draw.

The order is llama.cpp's sampler chain (penalties -> top-k -> top-p -> min-p -> temperature ->
draw), so top-p and min-p see the probabilities before temperature reshapes them. The penalties:

- `repetition_penalty` (llama.cpp's `--repeat-penalty`, CTRL's penalty with the sign fix): every
  token among the last `penalty_last_n` ids accepted (prompt included, as llama.cpp's server and CLI
  feed the prompt to the sampler) has a positive logit divided and a non-positive one multiplied,
  except a token that continues a passage of the prompt the reply is quoting (`QuotedRuns`: the last
  `QUOTE_RUN` ids and the token, in a row somewhere in the prompt). llama.cpp penalizes those too, and
  the penalty that stops a small model looping then makes it change code and text it was asked to give
  back (docs/benchmarks.md, "Quotes of the prompt"); a reply that repeats itself is penalized as before.
- `frequency_penalty` / `presence_penalty` (OpenAI's): logit -= count * frequency + (count > 0) *
  presence, where count is how often the token was generated so far in this reply (not the prompt,
  as OpenAI's and vLLM's docs define them; no window).

Before the penalties, `logit_bias` (OpenAI's): a number in [-100, 100] added to a token's logit at every step
(-100 all but bans the token, +100 all but forces it), as llama.cpp's chain adds it first.

Greedy (temperature 0) takes the argmax after the bias and the penalties, as llama.cpp does.

Two ways to the same draw: on a GPU every step is a tensor op over the whole vocabulary (no wait for the
host); on the CPU the filters look only at the tokens near the top, found with numpy (`host_sample`): torch's
sort of 128,256 logits takes longer than a decode step of the default model, and its argmax a tenth of one.
Both draw by an exponential race (argmax of p / E, E ~ Exp(1)), which a last-bit change in the logits rarely
turns: a batched step and a single one give the same seeded reply.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

PENALTY_RANGE = 2.0  # OpenAI accepts frequency/presence penalties in [-2, 2]
BIAS_RANGE = 100.0  # and logit biases in [-100, 100]
QUOTE_RUN = 3  # ids in a row, found in the prompt, after which the prompt's next id is a quote's (0: none is)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 is off
    top_p: float = 1.0  # 1 is off
    min_p: float = 0.0  # keep tokens with p >= min_p * p(top token); 0 is off
    repetition_penalty: float = 1.0  # 1 is off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64  # ids the repetition penalty looks back over; 0 is off, -1 is all
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias): added to that token's logit

    def __post_init__(self):
        def need(ok: bool, name: str, expected: str):
            if not ok:
                raise ValueError(f"sampling parameter {name}={getattr(self, name)!r}: expected {expected}")

        def number(name: str) -> bool:
            value = getattr(self, name)
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        def integer(name: str) -> bool:
            return isinstance(getattr(self, name), int) and not isinstance(getattr(self, name), bool)

        need(number("temperature") and self.temperature >= 0, "temperature", "a number >= 0")
        need(integer("top_k") and self.top_k >= 0, "top_k", "a whole number >= 0 (0 is off)")
        need(number("top_p") and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        need(number("min_p") and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]")
        need(number("repetition_penalty") and self.repetition_penalty > 0, "repetition_penalty",
             "a number > 0 (1 is off)")
        for name in ("frequency_penalty", "presence_penalty"):
            need(number(name) and abs(getattr(self, name)) <= PENALTY_RANGE, name,
                 f"a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]")
        need(integer("penalty_last_n") and self.penalty_last_n >= -1, "penalty_last_n",
             "a whole number >= -1 (0 is off, -1 is the whole history)")
        need(self.seed is None or integer("seed"), "seed", "a whole number or None")
        for token, bias in self.logit_bias:
            if not (isinstance(token, int) and not isinstance(token, bool) and token >= 0):
                raise ValueError(f"sampling parameter logit_bias: token id {token!r}: expected a whole number >= 0")
            if not (isinstance(bias, (int, float)) and not isinstance(bias, bool) and abs(bias) <= BIAS_RANGE):
                raise ValueError(f"sampling parameter logit_bias: the bias of token {token} is {bias!r}: expected "
                                 f"a number in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}]")


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, not waited for: on CUDA copied from pinned memory, where
    torch.tensor(values, device="cuda") waits for all the stream holds (a decode step queued ahead included)
    before it copies. torch's pinned allocator keeps the buffer until the copy is done."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def make_generator(seed: int | None, device="cpu") -> torch.Generator:
    """A private random stream, so one conversation's seed never depends on another's draws."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float = 1.0, generator: torch.Generator | None = None, min_p: float = 0.0) -> torch.Tensor:
    """logits (vocab,) -> token id (0-dim LongTensor on the logits' device): top-k, top-p, min-p, temperature,
    then a draw. temperature 0 is greedy (argmax: the first of equal logits). Stateless: penalties belong to a
    `Sampler`."""
    if logits.device.type == "cpu":
        return torch.tensor(host_sample(logits, temperature, top_k, top_p, generator, min_p))
    return tensor_sample(logits, temperature, top_k, top_p, generator, min_p)


def tensor_sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0,
                  generator: torch.Generator | None = None, min_p: float = 0.0) -> torch.Tensor:
    """sample() as tensor ops of fixed shapes over the whole vocabulary, nothing read back: a GPU's way."""
    if temperature <= 0:
        return logits.max(-1).indices
    logits, ids = filtered(logits, top_k, top_p, min_p)
    probs = torch.softmax(logits / temperature, dim=-1)
    # argmax(p / E) with E ~ Exp(1) draws from p (exponential race): one pass, no cumulative sums, no wait.
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    choice = torch.argmax(probs / noise)
    return choice if ids is None else ids[choice]


def filtered(logits: torch.Tensor, top_k: int | None, top_p: float, min_p: float):
    """(logits, ids): logits (vocab,) in fp32 with what top-k, top-p and min-p leave out at -inf, as tensor ops
    of fixed shapes (the GPU's way); ids maps their positions to token ids where top-k or top-p sorted them."""
    logits = logits.float()
    if top_k and top_k < logits.shape[-1]:
        logits, ids = torch.topk(logits, top_k)  # sorted, highest first
    elif top_p < 1.0:
        logits, ids = torch.sort(logits, descending=True)
    else:
        ids = None
    if top_p < 1.0:
        # Keep the smallest set of top tokens whose mass reaches top_p (always at least one).
        probs = torch.softmax(logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        logits = logits.masked_fill(mass_before >= top_p, -math.inf)
    if min_p > 0:
        # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p): no softmax needed.
        logits = logits.masked_fill(logits < logits.max() + math.log(min_p), -math.inf)
    return logits, ids


def host_sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0,
                generator: torch.Generator | None = None, min_p: float = 0.0) -> int:
    """sample() for logits in the CPU's memory: numpy's vectorized argmax (torch's keeps the index of the
    maximum element by element), the filters applied to the few tokens near the top (`kept`), and an exponential
    race among the kept tokens (`race`), its key drawn from `generator`."""
    x = logits.detach().float().contiguous().numpy()
    if temperature <= 0:
        return int(np.argmax(x))  # the first of equals; NaN counts as the largest, as in torch
    ids, values = kept(x, top_k, top_p, min_p)
    if temperature < np.finfo(np.float32).tiny:  # below float32's range (1e-300): as good as greedy, which it is
        return int(ids[np.argmax(values)])
    with np.errstate(over="ignore"):
        weights = np.exp((values - values.max()) / np.float32(temperature))
    return int(ids[race(int(torch.randint(0, 2**63 - 1, (), generator=generator)), ids, weights)])


RACE_ALL = 512  # up to this many kept tokens the race takes every logarithm


def race(key: int, ids: np.ndarray, weights: np.ndarray) -> int:
    """The position of the token drawn from weights (>= 0, the largest > 0) over token ids: the exponential
    race argmax(weight / E), as the GPU's way runs it, with each E ~ Exp(1) a function of (key, token id) alone.
    Keyed by id, not drawn in turn, so a token kept or not at a filter's edge (logits that differ in the last
    bits between a batched and a single step) changes nothing unless that token would have won.

    E = -log(u) >= 1 - u, so against the top token's score only tokens with 1 - u < weight / score can win:
    the logarithm is taken for those few (a flat distribution keeps tens of thousands of tokens)."""
    u = uniforms(key, ids)
    if len(ids) <= RACE_ALL:
        return int(np.argmax(weights / -np.log(u)))
    top = int(np.argmax(weights))
    score = float(weights[top]) / -math.log(u[top])
    near = np.flatnonzero(1.0 - u < weights * ((1.0 + 1e-6) / score))  # room for rounding; `top` is among them
    return int(near[np.argmax(weights[near] / -np.log(u[near]))])


FMIX = tuple(np.uint32(c) for c in (16, 0x85EBCA6B, 13, 0xC2B2AE35))  # murmur3's 32-bit finalizer
GOLDEN = np.uint32(0x9E3779B9)


def uniforms(key: int, ids: np.ndarray) -> np.ndarray:
    """A number in (0, 1) for each token id, a function of (key, id) alone: the id and the key's low half
    through murmur3's 32-bit finalizer, then its high half and the finalizer again (32-bit integer arithmetic,
    which numpy vectorizes, where 64-bit multiplies are slow)."""
    shift_a, multiply_a, shift_b, multiply_b = FMIX
    h = ids.astype(np.uint32)
    h *= GOLDEN
    h += np.uint32(key & 0xFFFFFFFF)
    for half in (np.uint32(key >> 32 & 0xFFFFFFFF), None):
        h ^= h >> shift_a
        h *= multiply_a
        h ^= h >> shift_b
        h *= multiply_b
        h ^= h >> shift_a
        if half is not None:
            h ^= half
    u = h.astype(np.float64)
    u += 0.5
    u *= 2.0**-32
    return u


def kept(x: np.ndarray, top_k: int | None, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The token ids that top-k, then top-p, then min-p keep of logits x (vocab,), and their logits. Each
    filter keeps a run of the likeliest tokens, so all are found among the tokens within some distance of the
    largest logit, widened until they hold what a filter needs; the vocabulary is never sorted."""
    ids = None  # every token
    if top_k and top_k < len(x):
        ids = top(x, top_k)
    if top_p < 1.0:
        ids = nucleus(x, ids, top_p)
    if min_p > 0:  # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p)
        floor = x.max() + math.log(min_p)
        ids = np.flatnonzero(x >= floor) if ids is None else ids[x[ids] >= floor]
    if ids is None:
        return np.arange(len(x)), x
    return ids, x[ids]


# How far below the largest logit nucleus() looks first; each miss doubles it, the last try takes every token.
REACH = (8.0, 16.0, 32.0, 64.0, math.inf)
MASS_ROUNDING = 1e-6  # a cumulative mass this close below top_p reaches it (float32 sums of the same terms differ)


def top(x: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest logits (in no order), of the finite ones only: sorted from the tokens near the
    largest where at least k and few are there (a model's usual logits), else torch's topk over all."""
    near = np.flatnonzero(x >= x.max() - REACH[0])
    if k <= len(near) <= 8 * k:
        return near[np.argsort(-x[near], kind="stable")[:k]]
    values, ids = torch.topk(torch.from_numpy(x), k)
    return ids.numpy()[values.numpy() > -math.inf]


def nucleus(x: np.ndarray, ids: np.ndarray | None, top_p: float) -> np.ndarray:
    """Of the tokens `ids` (None: all), the smallest set of the likeliest whose probability (softmax over
    `ids`, at temperature 1) reaches top_p: at least the likeliest token."""
    pool = x if ids is None else x[ids]
    best = pool.max()
    total = np.exp(pool - best).sum(dtype=np.float64)
    for reach in REACH:
        near = np.flatnonzero(pool >= best - reach if reach < math.inf else pool > -math.inf)
        order = near[np.argsort(-pool[near], kind="stable")]  # likeliest first (ties: lower id first)
        mass = np.cumsum(np.exp(pool[order] - best), dtype=np.float64) / total
        if mass[-1] >= top_p - MASS_ROUNDING or reach == math.inf:
            break
    count = min(int(np.searchsorted(mass, top_p - MASS_ROUNDING, side="left")) + 1, len(order))
    chosen = order[:count]
    return chosen if ids is None else ids[chosen]


class QuotedRuns:
    """Where a reply may be quoting its prompt: the ids that follow each run of `run` ids in the prompt.

    Each run is packed into one int64 (run * bits of an id, the bits the prompt's largest id needs), the
    keys sorted once, so a step's lookup is two binary searches, whatever the prompt's length.
    """

    def __init__(self, prompt: list[int], run: int | None = None):
        ids = np.asarray(prompt, dtype=np.int64)
        self.run = QUOTE_RUN if run is None else run
        self.bits = max(int(ids.max(initial=0)).bit_length(), 1)
        if self.run <= 0 or len(ids) <= self.run or self.run * self.bits > 63:  # nothing to quote, or too wide
            self.keys, self.next = np.empty(0, np.int64), np.empty(0, np.int64)
            return
        keys = np.zeros(len(ids) - self.run, dtype=np.int64)  # keys[i] packs ids[i : i + run]
        for j in range(self.run):
            keys = (keys << self.bits) | ids[j:len(ids) - self.run + j]
        order = np.argsort(keys, kind="stable")
        self.keys, self.next = keys[order], ids[self.run:][order]

    def after(self, last: list[int]) -> np.ndarray:
        """The ids that follow the last `run` ids of `last` somewhere in the prompt: none if they are not there."""
        last = last[len(last) - self.run:]
        if self.run <= 0 or len(last) < self.run or any(token >> self.bits for token in last):  # ids it never had
            return self.next[:0]
        key = 0
        for token in last:
            key = (key << self.bits) | token
        return self.next[np.searchsorted(self.keys, key, "left"):np.searchsorted(self.keys, key, "right")]


class Sampler:
    """The sampling state of one sequence: its parameters, seeded generator and token history.

    Call `accept(ids)` with the prompt ids, then `sample(logits)` and `accept([token])` for each new
    token. Ids accepted before the first `sample()` are the prompt: they count for the repetition
    penalty's window but not for the frequency/presence penalties.
    """

    def __init__(self, params: SamplingParams, device="cpu"):
        self.params = params
        self.generator = make_generator(params.seed, device=device)
        window = None if params.penalty_last_n < 0 else params.penalty_last_n
        self.recent: deque[int] = deque(maxlen=window)  # the last penalty_last_n ids, prompt included
        self.last: deque[int] = deque(maxlen=QUOTE_RUN)  # the ids a quote of the prompt would go on from
        self.prompt: list[int] = []  # ids accepted before the first sample(), while the penalty needs them
        self.quoted: QuotedRuns | None = None  # the prompt's runs, once sampling starts
        self.generated: dict[int, int] = {}  # token id -> times generated in this reply
        self.started = False  # has sample() been called (so accepted ids are generated ones)?
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias's (ids, biases), once on the device

    def accept(self, token_ids) -> None:
        for token in token_ids:
            token = int(token)
            self.recent.append(token)
            self.last.append(token)
            if self.started:
                self.generated[token] = self.generated.get(token, 0) + 1
            elif self.params.repetition_penalty != 1.0:
                self.prompt.append(token)

    def penalized(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (vocab,) float32 with the logit bias, then the repetition, frequency and presence penalties
        applied."""
        p = self.params
        logits = logits.float()
        if p.logit_bias:
            if self.bias is None:
                past = max(token for token, _ in p.logit_bias)
                if past >= logits.shape[-1]:
                    raise ValueError(f"logit_bias: token id {past} is not in the vocabulary (ids 0 to "
                                     f"{logits.shape[-1] - 1})")
                self.bias = (torch.tensor([token for token, _ in p.logit_bias], device=logits.device),
                             torch.tensor([bias for _, bias in p.logit_bias], dtype=torch.float32, device=logits.device))
            logits = logits.index_add(0, *self.bias)
        if p.repetition_penalty != 1.0 and self.recent:
            quoted = self.quoted or QuotedRuns(self.prompt)
            if self.started:  # the prompt is whole: its runs are kept for the reply's steps
                self.quoted, self.prompt = quoted, []
            spared = quoted.after(list(self.last)).tolist()  # the prompt's next ids, if the reply quotes it
            ids = device_tensor(sorted(set(self.recent).difference(spared)), torch.long, logits.device)
            seen = logits[ids]
            logits = logits.clone()
            logits[ids] = torch.where(seen <= 0, seen * p.repetition_penalty, seen / p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and self.generated:
            ids = device_tensor(list(self.generated), torch.long, logits.device)
            counts = device_tensor(list(self.generated.values()), logits.dtype, logits.device)
            logits = logits.index_add(0, ids, -(counts * p.frequency_penalty + p.presence_penalty))
        return logits

    def sample(self, logits: torch.Tensor) -> int:
        """The next token for logits (vocab,) of the next position; does not accept it."""
        return int(self.draw(logits))

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """sample() as a 0-dim tensor on the logits' device, without waiting for it (a GPU's next step can be
        queued on it before the host reads it); does not accept it."""
        self.started = True
        p = self.params
        return sample(self.penalized(logits), p.temperature, p.top_k, p.top_p, self.generator, p.min_p)


def token_logprobs(logits: torch.Tensor, token: int, top_n: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and its top_n (id, logprob) pairs, most likely first.

    From log_softmax of the raw logits (vocab,): the model's own distribution, before any penalty,
    filter or temperature, as OpenAI's `logprobs` reports it.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, min(max(top_n, 0), logprobs.shape[-1])) if top_n > 0 else None
    pairs = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
    return float(logprobs[token]), pairs
