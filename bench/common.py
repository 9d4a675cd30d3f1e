"""What both benchmarks share: random checkpoints of a preset's shape, memory readings, worker processes.

A benchmark runs each system in a fresh Python process (so memory peaks never mix): the parent calls
`run_worker(script, spec)`, the child reads the spec from argv, measures, and writes one JSON result.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the scripts run as `python bench/x.py` from anywhere
    sys.path.insert(0, str(ROOT))

CACHE = ROOT / "bench" / ".cache"
RESULTS = ROOT / "bench" / "results"
MB = 1e6

import torch  # noqa: E402  (after the path fix, like every import of `model`)

from model import kernels  # noqa: E402
from model.config import LlamaConfig  # noqa: E402
from model.options import ModelOptions  # noqa: E402

# Every benchmark process, workers included, uses the decode kernel as the app would with the same LLAMA_*
# variables (LLAMA_KERNELS, LLAMA_KERNEL_MARCH, LLAMA_DETERMINISTIC, LLAMA_CACHE_DIR).
OPTIONS = ModelOptions.from_env()
kernels.configure(**OPTIONS.kernel_options)


# ---------------------------------------------------------------------------------------------------------
# Random checkpoints


def hf_tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face Llama checkpoint of this shape (no lm_head when tied)."""
    d, hd, f = config.dim, config.head_dim, config.ffn_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d), "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (config.n_heads * hd, d),
            p + "self_attn.k_proj.weight": (config.n_kv_heads * hd, d),
            p + "self_attn.v_proj.weight": (config.n_kv_heads * hd, d),
            p + "self_attn.o_proj.weight": (d, config.n_heads * hd),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
    return shapes


def n_params(config: LlamaConfig) -> int:
    return sum(_numel(s) for s in hf_tensor_shapes(config).values())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def random_checkpoint(shape: str, seed: int = 0, vocab_size: int | None = None) -> Path:
    """`bench/.cache/<shape>-bf16/`: random bf16 weights of a preset's shape, as a Hugging Face folder
    (`<shape>-<vocab_size>-bf16/` with another vocabulary size).

    Written once with safetensors in HF names and our own `to_hf_config()`, so neither this nor our
    engine needs transformers. Matrices ~ N(0, 0.02), norms 1: values do not change the speed.
    Vocabularies other than Llama 3's get a byte-level tokenizer.json (the checkpoint loader needs one).
    """
    from safetensors.torch import save_file

    config = LlamaConfig.preset(shape).replace(dtype="bfloat16")
    folder = CACHE / f"{shape}-bf16"
    if vocab_size is not None:
        config = config.replace(vocab_size=vocab_size)
        folder = CACHE / f"{shape}-{vocab_size}-bf16"
    done = folder / "model.safetensors"
    if done.is_file() and (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    print(f"[bench] writing random {shape} weights to {folder} ...", file=sys.stderr, flush=True)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor_shape in hf_tensor_shapes(config).items():
        if len(tensor_shape) == 1:
            state[name] = torch.ones(tensor_shape, dtype=torch.bfloat16)
        else:  # row by row block so the float32 temporary stays small
            w = torch.empty(tensor_shape, dtype=torch.bfloat16)
            for start in range(0, tensor_shape[0], 8192):
                block = w[start:start + 8192]
                block.copy_(torch.randn(block.shape, generator=generator).mul_(0.02))
            state[name] = w
    hf_config = config.to_hf_config() | {"bos_token_id": 0, "eos_token_id": 1}
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    if config.vocab_size != 128256:
        write_byte_tokenizer(folder)
    tmp = folder / "model.safetensors.partial"
    save_file(state, tmp, metadata={"format": "pt"})
    tmp.rename(done)
    return folder


Q4_K_BLOCK, Q4_K_BYTES = 256, 144  # weights and bytes of a GGUF Q4_K block (model/block_formats.py)


def q4_k_checkpoint(folder: Path, seed: int = 0) -> Path:
    """`<folder>-q4_k/`: the float checkpoint `folder` with each layer matrix whose rows are whole Q4_K blocks
    as random Q4_K blocks (uint8 (N, K / 256, 144), as an imported GGUF keeps them), their d and dmin about the
    matrix's size; the rest (embedding, norms) as it is. For the GPU check: what such a file costs there."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    out = folder.parent / f"{folder.name}-q4_k"
    done = out / "model.safetensors"
    if done.is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for extra in folder.iterdir():  # config and tokenizer files
        if extra.is_file() and extra.suffix != ".safetensors":
            shutil.copy(extra, out / extra.name)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            w = f.get_tensor(name)
            if not (name.startswith("model.layers.") and w.dim() == 2 and w.shape[1] % Q4_K_BLOCK == 0):
                state[name] = w
                continue
            n, blocks = w.shape[0], w.shape[1] // Q4_K_BLOCK
            b = torch.randint(0, 256, (n, blocks, Q4_K_BYTES), dtype=torch.uint8, generator=generator)
            # d and dmin (fp16): a weight d sc q - dmin m, sc and m up to 63, q up to 15: about the matrix's size
            halves = torch.full((n, blocks, 2), float(w.float().std()) / 400).half()
            b[..., 0:4] = halves.view(torch.uint8)  # (n, blocks, 4): d, then dmin
            state[name] = b
    tmp = out / "model.safetensors.partial"
    save_file(state, tmp, metadata={"format": "pt"})
    tmp.rename(done)
    return out


def write_byte_tokenizer(folder: Path) -> None:
    """A 258-token byte-level tokenizer.json (256 bytes + <s> + </s>) with a trivial chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1} | {ch: i + 2 for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))


def random_prompt(vocab_size: int, n: int, seed: int = 1) -> list[int]:
    """n ids below the special tokens (Llama 3's start at 128000)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, min(vocab_size, 128000), (n,), generator=g).tolist()


# ---------------------------------------------------------------------------------------------------------
# Memory


def memory_mb() -> dict[str, float]:
    """Resident memory of this process now (rss, anon, file) and its peak so far (hwm), in MB.

    maxrss (getrusage) is there for reference only: Linux carries it over from the parent across fork
    and exec, so in a worker process it can be the parent's peak. VmHWM starts afresh at exec.
    """
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024 / MB  # kB
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB  # kB on Linux
    return {"rss": fields.get("VmRSS", 0.0), "anon": fields.get("RssAnon", 0.0),
            "file": fields.get("RssFile", 0.0), "hwm": fields.get("VmHWM", 0.0), "maxrss": maxrss}


def vm_hwm_mb(pid: int | str = "self") -> float:
    """Peak resident memory of a process (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def engine_pid(server_pid: int) -> int:
    """The engine process a server (`chainlit run app/main.py`, `python -m app.api`) started: its child."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in children:
        if "app.engine" in Path(f"/proc/{pid}/cmdline").read_text():
            return int(pid)
    raise RuntimeError(f"process {server_pid} has no engine process among its children {children}")


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct tensors in a module's state dict (a tied head counted once)."""
    seen, total = set(), 0
    for t in module.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------------------------------------------------
# Worker processes


def cpu_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all processes, all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_idle(max_wait: float, busy_cores: float = 0.25, window: float = 2.0) -> float:
    """Wait (up to max_wait s) until other processes use less than busy_cores; the load last seen, in cores."""
    deadline = time.monotonic() + max_wait
    while True:
        before = cpu_busy_s()
        time.sleep(window)
        load = (cpu_busy_s() - before) / window
        if load < busy_cores or time.monotonic() >= deadline:
            return load


def run_worker(script: Path, spec: dict, timeout: float = 1800, idle_wait: float = 0.0) -> dict:
    """Run `python script --worker SPEC_JSON --out FILE` in a fresh process; its JSON result, or an error.

    `other_load_cores` in the result: CPU the rest of the machine used meanwhile (cores, averaged), a
    measure of how much the figures were disturbed. With idle_wait, first wait up to that long for quiet.
    """
    out = RESULTS / f".worker-{os.getpid()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    load_before = wait_for_idle(idle_wait) if idle_wait > 0 else None
    start, busy, ours = time.perf_counter(), cpu_busy_s(), children_cpu_s()
    try:
        proc = subprocess.run([sys.executable, str(script), "--worker", json.dumps(spec), "--out", str(out)],
                              env=env, timeout=timeout, stdout=sys.stderr)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - start
    other = max(0.0, (cpu_busy_s() - busy) - (children_cpu_s() - ours)) / wall
    if proc.returncode != 0 or not out.is_file():
        return {"error": f"worker exited with status {proc.returncode}"}
    result = json.loads(out.read_text())
    out.unlink()
    result |= {"wall_s": wall, "other_load_cores": other, "load_before_cores": load_before}
    return result


def worker_arguments(parser) -> None:
    """The hidden arguments run_worker starts a script's worker with."""
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


def ran_as_worker(args, worker) -> bool:
    """If this process is run_worker's child (--worker SPEC --out FILE), run worker(spec, out): True."""
    if not args.worker:
        return False
    worker(json.loads(args.worker), args.out)
    return True


def write_result(path: str, result: dict) -> None:
    Path(path).write_text(json.dumps(result, indent=2))


def engine_version() -> str:
    """The last commit that touched model/, with "+changes" when model/ differs from it."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    commit = git("log", "-1", "--format=%h", "--", "model") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--", "model") else "")


def machine() -> dict:
    """CPU model, cores, the flags that decide bf16 speed, RAM, torch version."""
    from model import cpu

    info = {"cpu": cpu.model_name() or "unknown", "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "flags": {f: f in cpu.flags() for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")}}
    try:
        mem_kb = int(next(l for l in Path("/proc/meminfo").read_text().splitlines()
                          if l.startswith("MemTotal")).split()[1])
        info["ram_gib"] = round(mem_kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return info
