"""A decode step of fixed shapes, for GPUs: static KV slots, inputs in fixed buffers, one CUDA graph a shape.

Run op by op on a GPU, a decode step of the 1B shape is ~300 kernel launches from Python: 1.9 ms of GPU work
in a 7.6 ms step (docs/benchmarks.md, "On a GPU"). A CUDA graph records those launches once and replays
them with one call, but it replays the same addresses: the inputs must live in fixed buffers and every
key and value in memory allocated once. So here

- `SlotCache` holds the keys and values of `slots` sequences in two tensors allocated once,
  (n_layers, slots + 1, n_kv_heads, max_len, head_dim); `take()` hands out one slot as an ordinary
  KVCache (views of its slot, so prefill, Generation and the engine use it as any other), and the slot
  comes back when that KVCache is collected. The last slot is scratch, written by padding rows.
- `StaticDecoder.decode` is Llama.decode for rows whose caches are all slots of its SlotCache: the rows
  are padded to a batch size of BATCH_SIZES, so a few shapes serve every step, each replayed from its own
  graph on CUDA (captured on first use, or all at once by `capture_all` while the model loads). With the
  Triton kernels attention reads each row's own length, so one graph a batch size; with the torch forms
  the keys are attended over a length of a power of two (at least MIN_LENGTH), a graph for each. On the
  CPU the same step runs eagerly, which is how it is tested against the reference (Block.decode).

The step (`_step`) is the reference's maths in one batch: every row's keys and values are written into
its slot at its position before any row attends, and a row attends to its slot's positions up to its
own, so rows sharing a slot at consecutive positions (a speculative check) see each other as in
Llama.decode. model/llama.py stays the reference; this module adds nothing to its maths. It is written
for few kernels a layer: q|k|v and gate|up each one product (`fuse`: their matrices side by side, the
layers' own tensors views of them), and the rest as model/step_ops.py's operations, Triton kernels on a
GPU: the norm with the residual add before it, RoPE with the KV writes, attention over each row's own
length (so one graph a batch size serves every length), SiLU with the product by up.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F

from .config import LlamaConfig
from .kv_cache import KVCache
from .linear import fuse, linears, project
from .rope import Rope
from .step_ops import TORCH, step_ops

log = logging.getLogger(__name__)
BATCH_SIZES = (1, 2, 4, 8)  # rows of one step: the engine's batches are padded up to one of these
MIN_LENGTH = 256  # keys attended: the next power of two above the furthest position, at least this


class SlotCache:
    """Keys and values of up to `slots` sequences of up to `max_len` positions, allocated once."""

    def __init__(self, config: LlamaConfig, slots: int, max_len: int, *, device=None, dtype=torch.float32):
        shape = (config.n_layers, slots + 1, config.n_kv_heads, max_len, config.head_dim)  # + scratch slot
        self.config, self.max_len = config, max_len
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.scratch = slots
        self.free = list(range(slots))

    def take(self) -> KVCache | None:
        """A free slot as a KVCache (views into this cache's tensors), or None when every slot is taken."""
        if not self.free:
            return None
        slot = self.free.pop(0)
        cache = KVCache(self.config, self.max_len, storage=(self.k[:, slot:slot + 1], self.v[:, slot:slot + 1]))
        cache.slot = slot  # its k, v: (n_layers, 1, n_kv_heads, max_len, head_dim) views of that slot
        weakref.finalize(cache, self.free.append, slot)  # back to the free list when the KVCache is collected
        return cache

    def holds(self, caches: list[KVCache]) -> bool:
        """Whether every cache is a slot of this one."""
        return all(cache.slot is not None and cache.k.data_ptr() == self.k[:, cache.slot].data_ptr()
                   for cache in caches)


def padded(n: int, sizes) -> int:
    """The first of `sizes` (ascending) that is at least n."""
    return next(size for size in sizes if size >= n)


class StaticDecoder:
    """Llama.decode over a SlotCache in steps of fixed shapes: replayed CUDA graphs on a GPU, eagerly elsewhere."""

    def __init__(self, model, cache: SlotCache, *, batch_sizes=BATCH_SIZES, compile: bool = False, ops=None):
        self.model, self.cache = model, cache
        self.batch_sizes = tuple(sorted(batch_sizes))
        device = cache.k.device
        self.graphs_on = device.type == "cuda"
        rows = self.batch_sizes[-1]
        # the inputs of every step, at fixed addresses: a step of b rows reads their first b entries
        self.inputs = torch.zeros(3, rows, dtype=torch.long, device=device)
        self.tokens, self.slots, self.positions = self.inputs  # (rows,) views
        self.slots.fill_(cache.scratch)
        # written on the host, then copied in one go: pinned on a GPU (no staging copy, no wait), a ring of two
        # so the host fills one while the other's copy may still be queued (each waited for by its event)
        self.staging = [torch.zeros(3, rows, dtype=torch.long, pin_memory=self.graphs_on) for _ in range(2)]
        self.staged = [torch.cuda.Event() if self.graphs_on else None for _ in range(2)]
        self.turn = 0
        model.ensure_rope(cache.max_len)
        self.rope = Rope(model.rope.cos[:cache.max_len].to(model.compute_dtype),
                         model.rope.sin[:cache.max_len].to(model.compute_dtype))  # (max_len, head_dim)
        self.ops = ops or step_ops(device, model.config.head_dim)
        # each layer's q|k|v and gate|up as one matrix where their storage allows (else the layers side by side)
        self.projections = [(fused_or(block.attention.wq, block.attention.wk, block.attention.wv),
                             fused_or(block.feed_forward.w1, block.feed_forward.w3)) for block in model.layers]
        self.step = torch.compile(self._step, fullgraph=True, dynamic=False) if compile else self._step
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None  # one memory pool for every graph's intermediates (they never run at once)

    def lengths(self) -> list[int]:
        """The key lengths steps are run at: powers of two from MIN_LENGTH, and max_len; max_len alone where
        attention reads each row's own length (the Triton kernels)."""
        if self.ops.reads_own_length:
            return [self.cache.max_len]
        lengths, length = [], MIN_LENGTH
        while length < self.cache.max_len:
            lengths.append(length)
            length *= 2
        return lengths + [self.cache.max_len]

    def shape(self, rows: int, furthest: int) -> tuple[int, int]:
        """(batch size, key length) of the step for `rows` rows whose furthest position is `furthest`."""
        return padded(rows, self.batch_sizes), padded(furthest + 1, self.lengths())

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, caches: list[KVCache], positions: list[int]) -> torch.Tensor:
        """Llama.decode for caches that are slots of self.cache: tokens (b,) -> logits (b, vocab) in fp32."""
        rows = len(caches)
        if rows > self.batch_sizes[-1]:
            step = self.batch_sizes[-1]
            return torch.cat([self.decode(tokens[i:i + step], caches[i:i + step], positions[i:i + step])
                              for i in range(0, rows, step)])
        batch, length = self.shape(rows, max(positions))
        self.stage(tokens, [cache.slot for cache in caches], positions, batch)
        if not self.graphs_on:
            return self.step(self.tokens[:batch], self.slots[:batch], self.positions[:batch], length)[:rows]
        graph, logits = self.graphs.get((batch, length)) or self.capture(batch, length)
        graph.replay()
        return logits[:rows].clone()  # the graph's output buffer is written again by the next replay

    def stage(self, tokens: torch.Tensor, slots: list[int], positions: list[int], batch: int) -> None:
        """The step's inputs into their fixed buffers: rows' tokens, slots and positions, then padding rows (token
        0 at the scratch slot's position 0) up to `batch`, in one copy from the host; tokens already on the
        device (sampled there) are copied on the device, never through the host."""
        rows = len(slots)
        host, copied = self.staging[self.turn], self.staged[self.turn]
        self.turn ^= 1
        if copied is not None:
            copied.synchronize()  # this buffer's previous copy has left
        on_device = tokens.device == self.inputs.device
        host[0, :rows] = 0 if on_device else tokens
        host[1, :rows], host[2, :rows] = torch.tensor(slots), torch.tensor(positions)
        host[0, rows:batch], host[1, rows:batch], host[2, rows:batch] = 0, self.cache.scratch, 0
        self.inputs[:, :batch].copy_(host[:, :batch], non_blocking=copied is not None)
        if copied is not None:
            copied.record()
        if on_device:
            self.tokens[:rows].copy_(tokens)

    def capture(self, batch: int, length: int):
        """Record the step of this shape in a CUDA graph (after two runs on a side stream, which let lazy
        initialisation and autotuning happen outside the capture). Inputs point at the scratch slot."""
        inputs = self.tokens[:batch], self.slots[:batch], self.positions[:batch]
        saved = [t.clone() for t in inputs]
        self.slots[:batch].fill_(self.cache.scratch)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step(*inputs, length)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            logits = self.step(*inputs, length)
        self.graph_pool = graph.pool()
        for tensor, value in zip(inputs, saved):
            tensor.copy_(value)
        self.graphs[batch, length] = graph, logits
        return graph, logits

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every (batch size, length) step now, so no reply pays for it; the number of graphs."""
        if self.graphs_on:
            for batch in self.batch_sizes:
                for length in self.lengths():
                    if (batch, length) not in self.graphs:
                        self.capture(batch, length)
            torch.cuda.synchronize()
        return len(self.graphs)

    def held_bytes(self) -> int:
        """Device memory this decoder holds besides its slots: the fixed inputs, RoPE tables of its dtype where
        they are copies, and each graph's logits (its other intermediates are freed into the graphs' pool)."""
        copied = self.rope.cos.dtype != self.model.rope.cos.dtype  # else views of the model's tables
        rope = self.rope.cos.nbytes + self.rope.sin.nbytes if copied else 0
        return self.inputs.nbytes + rope + sum(logits.nbytes for _, logits in self.graphs.values())

    def _step(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, length: int):
        """One decode step of fixed shapes: tokens, slots, positions (b,), keys attended over `length`
        positions of each row's slot (or each row's own, as self.ops reads them) -> logits (b, vocab) in fp32.
        No Python branch looks at the data."""
        model, ops, n_heads = self.model, self.ops, self.model.config.n_heads
        layers, b = model.layers, tokens.shape[0]
        x = model.tok_embeddings(tokens).to(model.compute_dtype)  # (b, dim): the residual stream, added to in place
        h = ops.add_rms_norm(x, None, layers[0].attention_norm)
        for i, (block, (qkv, gate_up)) in enumerate(zip(layers, self.projections)):
            layer_k, layer_v = self.cache.k[i], self.cache.v[i]  # (slots + 1, kv, max_len, d)
            q = ops.rope_write(project(h, *qkv), self.rope.cos, self.rope.sin, positions, slots, layer_k, layer_v,
                               n_heads)  # (b, h, d); every row's key and value written before any attends
            out = ops.attend(q, layer_k, layer_v, slots, positions, length)  # (b, h, d)
            h = ops.add_rms_norm(x, block.attention.wo(out.view(b, -1)), block.ffn_norm)
            after = layers[i + 1].attention_norm if i + 1 < len(layers) else model.norm
            h = ops.add_rms_norm(x, block.feed_forward.w2(ops.silu_mul(project(h, *gate_up))), after)
        head = model.output
        return linears(h, [head.weight], [head.scale], [head.offset], fp32_out=True)


def fused_or(*layers) -> tuple:
    """The layers as one fused Linear (model/linear.py's fuse), or as they are where they cannot be."""
    fused = fuse(*layers)
    return layers if fused is None else (fused,)


def new_cache(model, max_len: int, *, device=None, dtype=torch.float32) -> KVCache:
    """A cache for one sequence of up to max_len positions, of the model's KV type (model.kv_type): a free
    slot of the model's SlotCache where it decodes with a StaticDecoder and the slot is long enough (the slots
    hold unquantized keys and values), else a KVCache of its own (decoded op by op)."""
    static = model.static
    if static is not None and max_len <= static.cache.max_len and model.kv_type == "bf16":
        cache = static.cache.take()
        if cache is not None:
            return cache
    return KVCache(model.config, max_len, device=device, dtype=dtype, kv_type=model.kv_type)


def in_slot(model, cache: KVCache) -> KVCache:
    """`cache` moved into a free slot of the model's SlotCache (copied), so its sequence decodes in the fixed
    steps; `cache` itself where it is a slot already, or no slot is free or long enough."""
    static = model.static
    if static is None or cache.slot is not None or cache.max_len > static.cache.max_len or cache.quantized:
        return cache
    slot = static.cache.take()
    if slot is None:
        return cache
    slot.chunk = cache.chunk
    return cache.copy_prefix(cache.length, slot.max_len, into=slot)


def attach(model, slots: int, max_len: int, *, compile: bool = False, capture: bool = True) -> StaticDecoder:
    """Give `model` a SlotCache of `slots` sequences of max_len positions and decode its slots' rows with a
    StaticDecoder (model.static); with capture, every step's graph is recorded now (on CUDA). Where the Triton
    kernels fail to build or run here, the step falls back to the torch forms, said in the log."""
    cache = SlotCache(model.config, slots, max_len, device=model.tok_embeddings.weight.device,
                      dtype=model.compute_dtype)
    model.static = StaticDecoder(model, cache, compile=compile)
    if capture:
        try:
            model.static.capture_all()
        except Exception as e:  # noqa: BLE001  (a Triton compile error on this GPU: the torch forms still work)
            if model.static.ops is TORCH:
                raise
            log.warning("decode step: the Triton kernels failed here (%s); using the torch forms", e)
            model.static = StaticDecoder(model, cache, compile=compile, ops=TORCH)
            model.static.capture_all()
    return model.static
