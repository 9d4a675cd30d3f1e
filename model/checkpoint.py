"""Open a checkpoint's weights memory-mapped and attach them to a model built on `meta`.

Four formats, told apart by the folder's contents (model/checkpoint_files.py finds which):
- "hf":   config.json + model.safetensors (or model-0000N-of-0000M.safetensors + index)
- "meta": params.json + consolidated.00.pth (Meta's `original/` folder)
- "pth":  a .pth state dict in our own names + config.json beside it
- "gguf": a GGUF file used where it lies (another app's store, model/stores.py): its metadata written once as
  files into the cache folder's gguf/, its tensors kept as an import keeps them (model/convert/gguf_tensors.py),
  views of the file's map but where they must be split (Q8_0, Q4_0, Q4_1) or permuted (q, k)

Loading never holds two copies of the weights: the model is built on the `meta` device, the file
is memory-mapped, and its tensors become the model's parameters (`load_state_dict(assign=True)`).
Only tensors whose dtype must change are copied, one at a time.

A "hf" checkpoint may hold quantized weights (an imported GGUF's, the default model's Q4_1; llama.cpp's blocks:
model/blocks.py), kept as they are, or widened at load where asked (`widen`; model/quantize.py describes the
layouts):
- int8: `<module>.weight` int8 (N, K) beside `<module>.scale` (N, K // group), one scale per group
  of a row, with `"quantization": {"method": "int8", "group_size": group}` in config.json;
- int4: `<module>.weight` uint8 (N, K // 2), two weights a byte, beside `<module>.scale` and
  `<module>.offset` (N, K // 32) (no offset: Q4_0's symmetric blocks), with
  `"quantization": {"method": "int4", "group_size": 32}`; such a folder may hold int8 tensors of the
  same group size too (a Q4_0 file's Q8_0 embedding).
"""

from __future__ import annotations

import json
import logging
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .blocks import block_format, dequantize_blocks, is_blocks, is_q4_k, q4_k_as_int4
from .chat_format import load_chat_format
from .checkpoint_files import CheckpointError, CheckpointFiles, find_checkpoint
from .config import DEFAULT_MAX_CONTEXT, ConfigError, LlamaConfig
from .cpu import has_native_bf16
from .kernels import configured, decode_path, kernels
from .kv_cache import Q8_BLOCK
from .linear import OUTPUT_HEAD, QUANTIZE, quantize_model
from .llama import Llama
from .memory import move_to_huge_pages, release_pages, scratch_returned
from .options import DTYPES, KV_TYPES
from .packed import packed_kinds, repack_model
from .quantize import INT4_GROUP, can_quantize_int4, dequantize, quantize_int4, quantize_int8
from .rope import permute_qk_rows
from .static_decode import attach
from .tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    model: Llama
    tokenizer: object
    chat_format: object
    config: LlamaConfig
    path: Path
    format: str
    stop_ids: set[int] = field(default_factory=set)
    generation_defaults: dict = field(default_factory=dict)  # from generation_config.json

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations, and of the KV cache's keys and values unless they are q8 blocks
        (model.kv_type)."""
        return self.model.compute_dtype

    @property
    def name(self) -> str:
        return self.path.name if self.path.is_dir() else self.path.stem


def read_config(files: CheckpointFiles, state: dict[str, torch.Tensor]) -> LlamaConfig:
    try:
        if files.format == "meta":  # params.json leaves the vocabulary size and tying to the weights
            embeddings = state.get("tok_embeddings.weight")
            return LlamaConfig.from_meta_params(
                files.config, vocab_size=None if embeddings is None else embeddings.shape[0],
                tie_word_embeddings="output.weight" not in state)
        return LlamaConfig.from_hf_config(files.config)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


# Hugging Face name -> our (Meta's) name.
HF_NAMES = [
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight", r"layers.\1.attention.w\2.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"layers.\1.feed_forward.w1.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"layers.\1.feed_forward.w2.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"layers.\1.feed_forward.w3.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
]
GRAPH_SLOTS = 8  # sequences of the static KV cache where decode steps are CUDA graphs (one batch of the engine)
IGNORED = re.compile(r"(.*rotary_emb\.inv_freq|rope\.freqs)$")  # RoPE tables some files carry


def hf_to_ours(name: str) -> str:
    for buffer in (".scale", ".offset"):  # a quantized weight's group scales and offsets are named after it
        if name.endswith(buffer):
            return hf_to_ours(name.removesuffix(buffer) + ".weight").removesuffix(".weight") + buffer
    for pattern, ours in HF_NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, ours, name)
    return name  # left for the unexpected-tensor check to report


def open_in_place(files: CheckpointFiles, cache_dir: Path) -> tuple[CheckpointFiles, dict[str, torch.Tensor]]:
    """A GGUF file used where it lies: its metadata's folder (model/convert/gguf.py in_place) as the checkpoint's
    folder, and its tensors in Hugging Face names (views of the file's map where the file's layout is kept)."""
    import warnings

    from .convert.folder import ConversionError
    from .convert.gguf import in_place

    try:
        folder, arrays = in_place(files.weights[0], cache_dir)
    except ConversionError as e:
        raise CheckpointError(str(e)) from None
    tensors = {}
    with warnings.catch_warnings():  # the map is read-only; the model never writes its weights
        warnings.simplefilter("ignore", UserWarning)
        for name, (array, dtype) in arrays.items():
            tensor = torch.from_numpy(array)
            tensors[name] = tensor.view(torch.bfloat16) if dtype == "BF16" else tensor
    return CheckpointFiles("gguf", folder / "config.json", files.weights, folder), tensors


def read_state_dict(files: CheckpointFiles, in_place: dict[str, torch.Tensor] | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors of the checkpoint in our names, memory-mapped, and each one's name in the file."""
    state: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    if in_place is not None:  # a GGUF's (open_in_place), in Hugging Face names
        for name, tensor in in_place.items():
            state[hf_to_ours(name)], names[hf_to_ours(name)] = tensor, name
        return state, names
    for file in files.weights:
        tensors = _open_safetensors(file) if file.suffix == ".safetensors" else _open_pth(file)
        for name, tensor in tensors.items():
            if IGNORED.fullmatch(name):
                continue
            ours = hf_to_ours(name) if files.format == "hf" else name
            state[ours], names[ours] = tensor, name
    return state, names


def _open_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt", device="cpu") as f:  # memory-mapped, zero copy
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _open_pth(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{file}: refused: the file holds Python objects other than tensors, and loading it could "
            f"run code. Only plain state dicts are loaded (weights_only=True). ({str(e).splitlines()[0]})"
        ) from None
    except Exception as e:
        raise CheckpointError(f"{file}: not a readable PyTorch file ({e})") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CheckpointError(f"{file}: expected a state dict (name -> tensor), found {type(state).__name__}")
    return state


def check_state_dict(state: dict[str, torch.Tensor], model: Llama, files: CheckpointFiles,
                     names: dict[str, str] | None = None) -> None:
    """Every tensor the config asks for is there, with its shape (int4: two weights a byte); nothing
    unknown is there."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    expected |= {n: (expected[n][0], expected[n][1] // 2) for n, t in state.items()
                 if t.dtype == torch.uint8 and t.dim() == 2 and len(expected.get(n, ())) == 2}
    expected |= {n: (expected[n][0], expected[n][1] // block_format(t).block, t.shape[2]) for n, t in state.items()
                 if is_blocks(t) and len(expected.get(n, ())) == 2}  # llama.cpp's blocks: (N, K / block, bytes)
    where = files.weights[0] if len(files.weights) == 1 else files.folder
    if model.config.tie_word_embeddings:
        expected.pop("output.weight")
        state.pop("output.weight", None)  # some files store the tied head anyway
    missing = sorted(set(expected) - set(state))
    unexpected = sorted((names or {}).get(n, n) for n in set(state) - set(expected))
    wrong = [f"{(names or {}).get(n, n)}: {tuple(state[n].shape)} in the file, {expected[n]} from {files.config.name}"
             for n in expected if n in state and tuple(state[n].shape) != expected[n]]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_some(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes: {_some(wrong)}")
    if problems:
        raise CheckpointError(f"{where}: does not match {files.config}: " + "; ".join(problems))


@dataclass
class Quantized:
    """A weight's quantization from the file: group scales, and int4 block offsets (None: int8, or Q4_0)."""

    scale: torch.Tensor
    offset: torch.Tensor | None = None


def take_quantized(state: dict[str, torch.Tensor], files: CheckpointFiles,
                   names: dict[str, str]) -> dict[str, Quantized]:
    """Move the group scales and offsets of quantized weights out of `state`: weight name -> Quantized.

    Every int8 weight needs its scale (N, K // group), every int4 one its scale and may have offsets
    (N, K // 32), for the group size of config.json's "quantization" entry.
    """
    found = {kind: {name.removesuffix(kind) + ".weight": state.pop(name) for name in list(state)
                    if name.endswith(kind)} for kind in (".scale", ".offset")}
    scales, offsets = found[".scale"], found[".offset"]
    int8 = {name for name, t in state.items() if t.dtype == torch.int8}
    int4 = {name for name, t in state.items() if t.dtype == torch.uint8 and not is_blocks(t)}
    if not scales and not offsets and not int8 and not int4:
        return {}
    where = files.weights[0] if len(files.weights) == 1 else files.folder
    quantization = _read_optional_json(files.config).get("quantization") or {}
    method, group = quantization.get("method"), quantization.get("group_size")
    expected = '"quantization": {"method": "int8", "group_size": N} or {"method": "int4", "group_size": 32}'
    if method not in QUANTIZE or not isinstance(group, int) or group <= 0 or (method == "int4") != bool(int4) or (
            method == "int4" and group != INT4_GROUP):
        held = "int4 (uint8) tensors" if int4 else "int8 tensors with scales"
        raise CheckpointError(f"{files.config}: the weights hold {held}, so expected {expected}, "
                              f"found {quantization or None}")
    problems = [f"{names.get(n, n)}: {'int8' if n in int8 else 'int4'} without a scale"
                for n in sorted((int8 | int4) - set(scales))]
    problems += [f"{names.get(n, n)}: a scale for a weight that is not int8 or int4"
                 for n in sorted(set(scales) - int8 - int4)]
    problems += [f"{names.get(n, n)}: an offset for a weight that is not int4" for n in sorted(set(offsets) - int4)]
    for name in sorted((int8 | int4) & set(scales)):
        weight = state[name]
        rows, cols = weight.shape if weight.dim() == 2 else (0, 0)
        k = 2 * cols if name in int4 else cols
        shape = (rows, k // group)
        buffers = [scales[name]] + ([offsets[name]] if name in offsets else [])
        if weight.dim() != 2 or k % group or any(tuple(t.shape) != shape for t in buffers):
            problems.append(f"{names.get(name, name)}: {tuple(weight.shape)} with scale {tuple(scales[name].shape)}"
                            + (f" and offset {tuple(offsets[name].shape)}" if name in offsets else "")
                            + f", expected {shape} for group_size {group}")
    if problems:
        raise CheckpointError(f"{where}: quantized weights: {_some(problems)}")
    return {name: Quantized(scales[name], offsets.get(name)) for name in scales}


def _some(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")


def resolve_device(device: str | torch.device) -> str | torch.device:
    """The device that "auto" stands for: CUDA where there is a GPU, then MPS (Apple), else the CPU. Any
    other device stays as it is."""
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A dtype given by name: a key of model.options.DTYPES ("bf16", "fp16", "fp32"), torch's own name
    ("bfloat16", ...), or "auto" (None: default_dtype decides). A torch dtype or None stays as it is."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    name = DTYPES.get(dtype, dtype)
    if name not in DTYPES.values():
        raise ValueError(f"dtype={dtype!r}: expected auto or one of {', '.join([*DTYPES, *DTYPES.values()])}")
    return getattr(torch, name)


def default_dtype(device: torch.device) -> torch.dtype:
    """How to store the weights: bf16 where it runs fast (native bf16, or the decode kernel), else fp32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.bfloat16 if has_native_bf16() or kernels() is not None else torch.float32


def blocks_decode_fast(device: torch.device) -> bool:
    """Whether int8 and int4 weights decode faster than float ones on `device`: on the CPU, where the decode
    kernel streams the blocks (the default model's Q4_1: 1.2-1.9x its bf16 speed, docs/benchmarks.md); on a
    GPU whose ops take both kinds repacked once at load (model/packed.py: tinygemm's int4, int8 rows); not
    elsewhere, nor on the CPU without the kernel, where every product would widen the whole matrix first (on
    an H100, a tenth of bf16's speed)."""
    if device.type == "cuda":
        return {"int4", "int8"} <= set(packed_kinds(device))
    return device.type == "cpu" and kernels() is not None


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Activations and the KV cache: the weights' dtype where the hardware computes in it, else fp32."""
    if dtype == torch.float32 or device.type != "cpu":
        return dtype
    return dtype if dtype == torch.bfloat16 and has_native_bf16() else torch.float32


def load_checkpoint(path: str | Path, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype | str | None = None, tokenizer: str | Path | None = None,
                    quantize: str | None = None, widen: bool | str = False, compile: bool = False,
                    pack: bool | str = "auto", graphs: bool | None = None, slots: int = GRAPH_SLOTS,
                    kv_type: str = "bf16") -> Checkpoint:
    """Load a checkpoint folder or file: model (in eval mode), tokenizer, chat format and config.

    device: a torch device, or "auto" (resolve_device: CUDA, then MPS, then the CPU).
    dtype: how weight matrices are stored, a torch dtype or its name (torch_dtype: "bf16", "bfloat16", ...;
    None or "auto": bf16 where that is fast, else fp32); the activations run in it too where the hardware
    computes natively in it, else in fp32.
    quantize: None or "off" keeps the weights in `dtype`; "int8" stores the linear layers as int8 with one
    scale per 64 weights of a row; "int4" the layers' matrices as int4 with one scale and offset per 32 and
    the output head as int8 (OUTPUT_HEAD).
    The embedding table stays in `dtype`; a tied output head gets its own quantized copy. Weights
    quantized in the file stay as they are, with the file's scales and offsets, whatever `dtype` and
    `quantize`, unless `widen`.
    widen: weights quantized in the file are widened at load to the float32 values they stand for (each
    one exact), then stored as a float32 file's would be (`dtype`, `quantize`). "auto": widened only where
    no decode kernel multiplies them (blocks_decode_fast), so where keeping them would be slower.
    compile: run single-token decode steps through torch.compile (compiled on the first reply); with graphs,
    the static step is compiled (its small ops fused) before its graphs are captured.
    pack: int8 and int4 matrices (not the embedding) repacked for torch's weight-only matmul ops, which then
    multiply them (model/packed.py: int8 from the file requantized to one scale per row; quantized here, int8 gets
    one scale per row at once; a GGUF's Q4_K blocks become int4, model/blocks.py). "auto": on a GPU, where they
    replace widening on every product; True: on the CPU too (its ops do the same maths: tests); False: never.
    graphs: decode in steps of fixed shapes over `slots` static KV slots, each step a replayed CUDA graph
    (model/static_decode.py), captured here so the first reply does not pay for it. None: on CUDA devices.
    kv_type: how the KV caches made for this model keep keys and values (model/kv_cache.py): "bf16" in the
    activations' dtype, "q8" in 8-bit blocks (the static slots, and so the CUDA graphs, hold bf16 only).
    """
    quantize = None if quantize == "off" else quantize
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize={quantize!r}: expected None, off or one of {', '.join(QUANTIZE)}")
    if widen not in (True, False, "auto"):
        raise ValueError(f"widen={widen!r}: expected True, False or auto")
    if pack not in (True, False, "auto"):
        raise ValueError(f"pack={pack!r}: expected True, False or auto")
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type={kv_type!r}: expected one of {', '.join(KV_TYPES)}")
    dtype = torch_dtype(dtype)
    files = find_checkpoint(path)
    in_place = None
    if files.format == "gguf":  # used where it lies; its metadata as files in the cache folder
        files, in_place = open_in_place(files, configured().cache_dir)
    state, names = read_state_dict(files, in_place)
    in_file = take_quantized(state, files, names)
    config = read_config(files, state)
    device = torch.device(resolve_device(device))
    if device.type == "cpu":  # built (or loaded from its cache) now, not on the first reply
        log.info("decode kernel: %s", decode_path())
    if widen == "auto":
        widen = not blocks_decode_fast(device)
    dtype = dtype or default_dtype(device)
    compute = compute_dtype(dtype, device)
    pack = pack is True or (pack == "auto" and device.type == "cuda")
    row_scales = pack and "int8" in packed_kinds(device)  # int8 quantized here is rounded once, to row scales

    with torch.device("meta"):
        model = Llama(config).requires_grad_(False)
    check_state_dict(state, model, files, names)
    with scratch_returned():
        quantized: dict[str, Quantized] = {}
        for name, mapped in state.items():
            tensor = mapped
            if files.format == "meta" and name.endswith(("attention.wq.weight", "attention.wk.weight")):
                n_heads = config.n_heads if name.endswith("wq.weight") else config.n_kv_heads
                tensor = permute_qk_rows(tensor, n_heads, to="half")
            if widen and name in in_file:  # from here on as a float32 file's weight
                q = in_file.pop(name)
                tensor = dequantize(tensor, q.scale, q.offset)
            elif is_blocks(tensor) and (widen or device.type != "cpu" and not (pack and is_q4_k(tensor))):
                tensor = dequantize_blocks(tensor)  # only the CPU's kernel reads blocks; torch's int4 op, Q4_K's
            if name in in_file:  # quantized in the file: its values, scales and offsets are kept as they are
                tensor = tensor.to(device)
                quantized[name] = _file_buffers(in_file[name], tensor.dtype, device)
            elif pack and is_q4_k(tensor):  # as int4, for torch's op (repack_model below)
                tensor, scale, offset = (t.to(device) for t in q4_k_as_int4(tensor))
                quantized[name] = Quantized(scale, offset)
            elif is_blocks(tensor):  # llama.cpp's blocks, as the file has them
                pass
            elif quantize == "int8" and name.startswith("layers.") and tensor.dim() == 2:
                tensor, scale = quantize_int8(tensor.to(device), group=tensor.shape[1] if row_scales else None)
                quantized[name] = Quantized(scale)
            elif quantize == "int4" and name.startswith("layers.") and can_quantize_int4(tensor):
                tensor, scale, offset = quantize_int4(tensor.to(device))
                quantized[name] = Quantized(scale, offset)
            else:  # matrices in `dtype`, norms in the compute dtype; no copy for a matching file
                tensor = tensor.to(device=device, dtype=dtype if tensor.dim() == 2 else compute)
            if tensor is not mapped:
                release_pages(mapped)  # the copy replaces the file's pages: don't keep both resident
            state[name] = tensor
        packed = {name: state.pop(name) for name in list(state) if state[name].dtype == torch.uint8}
        model.load_state_dict(state, strict=False, assign=True)  # packed int4 weights differ in shape: set below
        del state
        for name, tensor in packed.items():
            model.get_submodule(name.removesuffix(".weight")).weight = torch.nn.Parameter(tensor, requires_grad=False)
        for name, q in quantized.items():
            module = model.get_submodule(name.removesuffix(".weight"))
            module.scale, module.offset = q.scale, q.offset
        model.tie_weights()
        if config.tie_word_embeddings:  # a quantized embedding's head shares its scales and offsets
            model.output.scale, model.output.offset = model.tok_embeddings.scale, model.tok_embeddings.offset
        model.compute_dtype = compute
        if kv_type == "q8" and config.head_dim % Q8_BLOCK:
            raise CheckpointError(f"{files.folder}: a q8 KV cache takes a head_dim that is a multiple of {Q8_BLOCK}; "
                                  f"this model's is {config.head_dim} (LLAMA_KV_TYPE=bf16 works for it)")
        model.kv_type = kv_type
        if quantize is not None:
            quantize_model(model, OUTPUT_HEAD[quantize], row_scales)  # what is left: the output head
        if pack:
            if repacked := repack_model(model):
                log.info("%d matrices repacked for torch's %s ops (%s)", repacked, ", ".join(packed_kinds(device)),
                         device.type)
    model.setup_rope(min(config.max_seq_len, DEFAULT_MAX_CONTEXT))
    model.eval().requires_grad_(False)
    if (device.type == "cuda" if graphs is None else graphs) and kv_type == "bf16":
        attach(model, slots, model.rope.max_len, compile=compile)
    elif compile:
        model.decode = torch.compile(model.decode, dynamic=True)
    if device.type == "cpu":
        moved = move_to_huge_pages(model.state_dict().values())
        log.info("weights in 2 MB pages: %.0f MB", moved / 1e6)

    tok = _load_tokenizer(files, tokenizer)
    if tok.vocab_size > config.vocab_size:
        raise CheckpointError(f"{files.folder}: the tokenizer has {tok.vocab_size} tokens but the model "
                              f"only {config.vocab_size} embeddings; wrong tokenizer for this checkpoint?")
    generation = _read_optional_json(files.folder / "generation_config.json")
    return Checkpoint(model=model, tokenizer=tok, chat_format=load_chat_format(tok, files.folder, config),
                      config=config, path=Path(path), format=files.format,
                      stop_ids=set(tok.stop_ids) | _eos_ids(generation) | _eos_ids(
                          _read_optional_json(files.folder / "config.json")),
                      generation_defaults=generation)


def _file_buffers(q: Quantized, weight_dtype: torch.dtype, device: torch.device) -> Quantized:
    """A file's scales (and offsets) on `device`: fp32 for int8 (the kernel's), fp16 for int4 (the
    file's own, which the kernel reads); the file's pages dropped where a copy replaces them."""
    dtype = torch.float32 if weight_dtype == torch.int8 else torch.float16
    kept = []
    for mapped in (q.scale, q.offset):
        tensor = None if mapped is None else mapped.to(device=device, dtype=dtype)
        if tensor is not None and tensor is not mapped:
            release_pages(mapped)
        kept.append(tensor)
    return Quantized(*kept)


def _load_tokenizer(files: CheckpointFiles, override):
    try:
        return load_tokenizer(files.folder, override)
    except Exception as e:
        raise CheckpointError(f"{files.folder}: cannot load the tokenizer ({e})") from None


def _read_optional_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _eos_ids(config: dict) -> set[int]:
    eos = config.get("eos_token_id")
    if eos is None:
        return set()
    return {int(i) for i in (eos if isinstance(eos, list) else [eos])}
