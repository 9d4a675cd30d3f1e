"""GB/s of the decode kernel's ops on every matrix call of a decode step, beside the bandwidth probe
and F.linear, for M = 1, 2, 4, 8 rows of x and each build of the kernel (native, znver3, x86-64).

    python bench/kernels.py [--models smollm2-135m,llama3.2-1b] [--rows 1,2,4,8] [--builds native,znver3,x86-64]

The calls are the ones a decode step makes: q|k|v in one call, wo, gate|up in one call, w2, and the
output head. Each is timed over enough copies of its weights (at least --footprint MB, as the layers
of a model are) that they stream from memory, not from the caches; GB/s = weight bytes (int8, int4:
with their scales and offsets) / seconds per call, best of --repeats passes over the copies. The probe is x.sum() over
--footprint MB of fp32, its passes taken in turn with the op's, so that each figure has a probe
measured at the same moments (this VM's bandwidth moved between 30 and 90 GB/s from one minute to
the next); a figure's percentage is of its own probe, and the "probe" column is the highest of the
row. Before each row the script waits (up to --idle-wait s) for other processes to go quiet; "other
load" is the cores they used during the row.

Columns, per build: "bf16" = bf16 weights with bf16 x (vdpbf16ps, native AVX-512 BF16 builds only:
other CPUs run fp32 activations; on CPUs with AMX, 2+ rows of K >= 1024 take the tiles), "bf16 loop" =
the same with the tiles switched off (AMX builds only), "bf16/fp32" = bf16 weights with fp32 x,
"int8" = int8 weights with fp32 x (on CPUs with AMX, 2+ rows of K >= 1024 take the tiles), "int8 loop"
= the same with the tiles off (AMX builds only), "int4" = int4 weights (model/quantize.py: 4 bits, fp16 scale and offset per 32) with fp32 x;
"int4 x" = how many times faster the first build's int4 call is than its bf16 call (bf16 x where the
build has vdpbf16ps, else fp32 x), by time. F.linear is bf16 x bf16 weights (oneDNN), the path without
the kernel. Results: a table on
stdout and bench/results/kernels.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch  # noqa: E402  (imported by common after its path fix)
import torch.nn.functional as F  # noqa: E402
from common import RESULTS, cpu_busy_s, machine, wait_for_idle

from model.config import LlamaConfig  # noqa: E402
from model.kernels import KernelBuildError, build  # noqa: E402
from model.quantize import quantize_int4, quantize_int8  # noqa: E402


def decode_calls(config: LlamaConfig) -> dict[str, tuple[list[int], int]]:
    """Name -> (N of each matrix in the call, K): the kernel calls of one decode step."""
    d, hd, f = config.dim, config.head_dim, config.ffn_dim
    return {"q|k|v": ([config.n_heads * hd, config.n_kv_heads * hd, config.n_kv_heads * hd], d),
            "wo": ([d], config.n_heads * hd), "gate|up": ([f, f], d), "w2": ([d], f),
            "output": ([config.vocab_size], d)}


def measure(call, copies: list, repeats: int, probe: torch.Tensor) -> tuple[float, float]:
    """GB/s of call() and of the probe, each the best of `repeats` passes, the passes alternating.

    One pass of call() goes once through every copy of the weights; one pass of the probe sums it.
    """
    def one_pass():
        for weights in copies:
            call(weights)
    nbytes = sum(t.nbytes for t in flat(copies))
    one_pass()  # warm-up: page faults, thread pool
    best_op = best_probe = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        probe.sum().item()
        middle = time.perf_counter()
        one_pass()
        best_probe, best_op = min(best_probe, middle - start), min(best_op, time.perf_counter() - middle)
    return nbytes / best_op / 1e9, probe.nbytes / best_probe / 1e9


def without_tiles(ops, product):
    """product (a function of the weights) through the AVX-512 loops where the build would take the AMX tiles."""
    def run(ws):
        before = ops.set_amx(False)
        try:
            return product(ws)
        finally:
            ops.set_amx(before)
    return run


def flat(items) -> list[torch.Tensor]:
    if isinstance(items, torch.Tensor):
        return [items]
    return [t for item in items for t in flat(item)]


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--models", default="smollm2-135m,llama3.2-1b")
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--builds", default="native,znver3,x86-64", help="-march of each build of the kernel")
    p.add_argument("--calls", default=None, help="comma list of calls to run (default: all)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--footprint", type=float, default=256, help="MB of weight copies per matrix (default 256)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--idle-wait", type=float, default=20.0,
                   help="before each row, wait up to this many seconds for other processes to go quiet")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    builds = {}
    for march in args.builds.split(","):
        try:
            builds[march] = build(march)
        except KernelBuildError as e:
            print(f"{march}: skipped ({e})", flush=True)
    info = machine()
    print(f"{info['cpu']}, {args.threads} threads, torch {info['torch']}; builds: "
          + ", ".join(f"{m} = {b.path}" for m, b in builds.items()), flush=True)
    probe_x = torch.ones(int(args.footprint * 1e6 / 4))  # fp32, as many bytes as the weights of a row
    def bf16_x(b) -> list[str]:  # the bf16-x columns of a build: with AMX, its loop beside the tiles
        if not b.path.startswith("AVX-512 BF16"):
            return []
        return ["bf16", "bf16 loop"] if "AMX" in b.path else ["bf16"]

    columns = ["F.linear"] + [f"{march} {op}" for march, b in builds.items()
                              for op in bf16_x(b) + ["bf16/fp32", "int8"] + (["int8 loop"] if "AMX" in b.path else [])
                              + ["int4"]]
    first = next(iter(builds), None)
    print("| model | call | N x K | M | probe GB/s | " + " | ".join(columns) + " | int4 x | other load |")
    print("|---|---|---|---|---|" + "---|" * len(columns) + "---|---|")
    results = []
    for model in args.models.split(","):
        config = LlamaConfig.preset(model)
        for call, (ns, k) in decode_calls(config).items():
            if args.calls and call not in args.calls.split(","):
                continue
            g = torch.Generator().manual_seed(0)
            one = [torch.randn(n, k, generator=g).mul_(0.02).bfloat16() for n in ns]
            nbytes = sum(w.nbytes for w in one)
            n_copies = max(1, round(args.footprint * 1e6 / nbytes))
            bf16 = [one] + [[w.clone() for w in one] for _ in range(n_copies - 1)]
            int8 = [[quantize_int8(w) for w in ws] for ws in bf16]
            int4 = [[quantize_int4(w) for w in ws] for ws in bf16]
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, generator=g)
                xb = x.bfloat16()
                if args.idle_wait > 0:
                    wait_for_idle(args.idle_wait)
                start, busy, ours = time.perf_counter(), cpu_busy_s(), own_cpu_s()
                row = {"model": model, "call": call, "n": ns, "k": k, "m": m}
                runs = {"F.linear": (lambda ws: [F.linear(xb, w) for w in ws], bf16)}
                for march, b in builds.items():
                    ops = b.ops
                    if "bf16" in bf16_x(b):
                        runs[f"{march} bf16"] = (lambda ws, ops=ops: ops.matvec_bf16(xb, ws), bf16)
                    if "bf16 loop" in bf16_x(b):
                        runs[f"{march} bf16 loop"] = (without_tiles(ops, runs[f"{march} bf16"][0]), bf16)
                    runs[f"{march} bf16/fp32"] = (lambda ws, ops=ops: ops.matvec_bf16(x, ws), bf16)
                    runs[f"{march} int8"] = (
                        lambda qs, ops=ops: ops.matvec_int8(x, [q for q, _ in qs], [s for _, s in qs]), int8)
                    if "AMX" in b.path:
                        runs[f"{march} int8 loop"] = (without_tiles(ops, runs[f"{march} int8"][0]), int8)
                    runs[f"{march} int4"] = (lambda qs, ops=ops: ops.matvec_int4(
                        x, [q for q, _, _ in qs], [s for _, s, _ in qs], [o for _, _, o in qs]), int4)
                for column, (run, copies) in runs.items():
                    row[column], row[f"{column} probe"] = measure(run, copies, args.repeats, probe_x)
                row["probe_gbps"] = max(row[f"{c} probe"] for c in columns)
                if first is not None:  # by time: GB/s over the bytes each reads
                    bf16_column = f"{first} bf16" if f"{first} bf16" in row else f"{first} bf16/fp32"
                    row["int4_speedup"] = (row[f"{first} int4"] / sum(t.nbytes for t in flat(int4[0]))) / (
                        row[bf16_column] / nbytes)
                row["other_load_cores"] = max(0.0, (cpu_busy_s() - busy) - (own_cpu_s() - ours)) / (
                    time.perf_counter() - start)
                results.append(row)
                cells = " | ".join(f"{row[c]:.1f} ({100 * row[c] / row[f'{c} probe']:.0f}%)" for c in columns)
                print(f"| {model} | {call} | {sum(ns)} x {k} | {m} | {row['probe_gbps']:.1f} | {cells} | "
                      f"{row.get('int4_speedup', float('nan')):.2f} | {row['other_load_cores']:.2f} |", flush=True)
            del bf16, int8, int4
    print("\n(percent: of the probe measured in turn with that figure)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "kernels.json"
    out.write_text(json.dumps({"machine": info, "threads": args.threads,
                               "builds": {m: b.path for m, b in builds.items()}, "rows": results}, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
