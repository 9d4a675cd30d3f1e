"""One round of bench/ab.py in one version of the engine: prints one JSON line of tokens/s.

    python bench/ab_worker.py --root TREE --checkpoint FOLDER [--threads N] [--context N --kv q8]

Imports `model` from TREE, so it uses only what every version has: load_checkpoint, KVCache, the
model's forward pass (prefill) and Llama.decode (decode steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--context", type=int, default=0)
    p.add_argument("--kv", default="bf16")
    args = p.parse_args()
    sys.path.insert(0, args.root)
    import torch

    from model import KVCache, load_checkpoint

    try:  # a version whose model package takes LLAMA_KERNELS etc. as arguments (model/options.py) ...
        from model import kernels
        from model.options import ModelOptions
        kernels.configure(**ModelOptions.from_env().kernel_options)
    except ImportError:  # ... or an older one, which reads them itself
        pass
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.checkpoint, dtype=torch.bfloat16)
    net, config = ckpt.model, ckpt.config
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(2, min(config.vocab_size, 128000), (n,), generator=g).tolist()

    def prefill(prompt: list[int], max_len: int, **kv_type) -> tuple[KVCache, int]:
        cache = KVCache(config, max_len, dtype=net.compute_dtype, **kv_type)
        for start in range(0, len(prompt), 256):
            chunk = prompt[start:start + 256]
            logits = net(torch.tensor([chunk]), start_pos=start, kv_cache=cache, last_only=True)[0, -1]
            cache.tokens.extend(chunk)
        return cache, int(logits.argmax())

    def decode(caches: list[KVCache], tokens: list[int], steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            logits = net.decode(torch.tensor(tokens), caches)
            for cache, token in zip(caches, tokens):
                cache.tokens.append(token)
            tokens = logits.argmax(-1).tolist()
        return len(caches) * steps / (time.perf_counter() - started)

    with torch.inference_mode():
        prompt = ids(512)
        prefill(prompt, 600)  # warm: pages of the file, the kernel's first calls
        times = []
        for _ in range(5):
            started = time.perf_counter()
            prefill(prompt, 600)
            times.append(time.perf_counter() - started)
        result = {"prefill": 512 / statistics.median(times)}
        one = []
        for _ in range(3):
            cache, token = prefill(ids(64), 200)
            one.append(decode([cache], [token], 64))
        result["decode_1"] = statistics.median(one)
        batch = [prefill(ids(40 + 10 * i), 200) for i in range(8)]
        decode([c for c, _ in batch], [t for _, t in batch], 4)  # warm
        result["decode_8"] = decode([c for c, _ in batch], [t for _, t in batch], 32)
        if args.context:  # one chunk's keys and values copied along the cache: a long context without its prefill
            n = args.context
            cache, token = prefill(ids(256), n + 64, **({"kv_type": args.kv} if args.kv != "bf16" else {}))
            for start in range(256, n, 256):
                end = min(n, start + 256)
                cache.k[..., start:end, :] = cache.k[..., :end - start, :]
                cache.v[..., start:end, :] = cache.v[..., :end - start, :]
            cache.tokens = (cache.tokens * (n // 256 + 1))[:n]
            decode([cache], [token], 2)  # warm
            result[f"decode_at_{n}"] = decode([cache], [token], 32)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
