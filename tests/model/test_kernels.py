"""The decode kernel's ops (model/csrc/matvec.cpp) against F.linear on the dequantized weights, for
every number of rows of x it takes (1 to MAX_KERNEL_ROWS), odd K and N, bf16, int8 and int4 weights, in
each of five builds: -march=native (this CPU's code), znver3 (the AVX2 code, which an AVX-512
machine runs too), x86-64 (the plain loops), skylake-avx512 (AVX-512 without VNNI or BF16) and
alderlake (AVX2 with AVX-VNNI). A build is skipped only where the compiler cannot produce it (on other
architectures) or this CPU cannot run its code (NEEDS).

Tolerances, per output y[m, n], against the exact result (float64) with E = sum_k |w[n, k] x[m, k]|:
- fp32 summation: the kernel sums K products in its own order (blocks, lanes, threads), F.linear in
  another; each addition rounds by at most 2^-24 of the running sum, and rounding errors of random
  signs grow like sqrt(K): we allow 4 sqrt(K) 2^-24 E, several times what is seen, and far below
  one product lost or counted twice for the sizes tested.
- bf16 output (x in bf16): y is rounded to bf16 at the end, 2^-9 of |y| at most; 2^-8 allowed.
- int8 weights: the kernel rounds each row of x to int16 with one scale (max |x[m]| / 32767), an
  error of at most half a step per element, so at most sum_k |w[n, k]| max|x[m]| / 65534 in y.
- int4 weights: the kernel rounds x to int16 as for int8 weights (the same extra error) or, in the
  AVX-512 and AVX2 builds (by default; both are tested there), to int8 per block of 32 with the block's own
  scale (max |x| of the block / 127: at most sum over k of |w[n, k]| max|x[m, block of k]| / 254 in
  y), takes each block's integer dot product with the 4-bit q exactly and scales it in fp32, adding
  offset times the block's sum of x as rounded: against the exactly dequantized matrix, the fp32
  summation bound is also taken with E over |q scale| + |offset| (what those products' rounding is
  relative to).
"""

import fcntl
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
from support.checkpoints import hf_model
from support.gguf_checkpoints import random_blocks
from support.kernels import amx_tiles, configured, has_int8_x, x_in_int8, x_in_int8_blocks

import model.kernels
from model import cpu, load_checkpoint
from model.block_formats import BY_NAME, FORMATS
from model.kernels import CSRC, KernelBuildError, build, build_folder, decode_path
from model.linear import MAX_KERNEL_ROWS
from model.quantize import dequantize_int4, dequantize_int8, int4_offset, quantize_int4, quantize_int8, unpack_int4

ROWS = range(1, MAX_KERNEL_ROWS + 1)
# (N, K): odd sizes for the tails, K of the real models (576, 1536, 2048), N over many tasks and threads.
SHAPES = [(1, 5), (7, 37), (3, 517), (1003, 576), (129, 1536), (67, 2048 + 31)]
# int8: K of groups that the intrinsics step through (576, 1536, 2048: groups of 64) and of groups
# that go to the plain loop on some instruction sets (96: groups of 48; 517: 47; 5: 5). Rows of x
# longer than 32 KB in all are read in pieces of K (2079 and 4160 here, for several rows).
INT8_SHAPES = [(1, 5), (7, 96), (3, 517), (1003, 576), (129, 1536), (67, 2048), (5, 4160)]
# int4: K in whole blocks of 32, odd numbers of them (96, 544: not multiples of 64), the real models'
# (576, 1536, 2048) and rows of x read in pieces of K (8224 for several rows).
INT4_SHAPES = [(1, 32), (7, 96), (3, 544), (1003, 576), (129, 1536), (67, 2048), (5, 8224)]


BUILDS = {"native": None, "znver3": "AVX2", "x86-64": "portable",  # -march -> the code it must compile
          "skylake-avx512": "AVX-512", "alderlake": "AVX2"}  # AVX-512 without VNNI and BF16; AVX2 with AVX-VNNI
# The CPU flags a build's code needs beyond what every x86-64 CPU has: where this CPU lacks them the
# build is skipped (it cannot run here).
NEEDS = {"znver3": {"avx2", "fma", "f16c"}, "skylake-avx512": {"avx512f", "avx512bw", "f16c"},
         "alderlake": {"avx2", "fma", "f16c", "avx_vnni"}}


def native_path() -> str:
    if cpu.has_avx512():
        if cpu.has_amx():
            return "AVX-512 BF16 + AMX"
        return "AVX-512 BF16" if cpu.has_avx512_bf16() else "AVX-512"
    return "AVX2" if cpu.has_avx2() else "portable"


@pytest.fixture(scope="module", params=list(BUILDS))
def kernels(request):
    march = request.param
    if not NEEDS.get(march, set()) <= cpu.flags():
        pytest.skip(f"this CPU cannot run -march={march}'s code (it lacks {sorted(NEEDS[march] - cpu.flags())})")
    try:
        return build(march)
    except KernelBuildError as e:
        if march == "native":
            pytest.fail(f"the decode kernel did not build for this CPU (is a C++ compiler installed?): {e}")
        pytest.skip(f"the compiler cannot build -march={march} here: {e}")


@pytest.fixture(scope="module")
def ops(kernels):
    return kernels.ops


def test_each_build_compiled_the_code_of_its_instruction_set(kernels):
    assert kernels.path == (BUILDS[kernels.march] or native_path())


def data(n, k, m, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)


def bound(w, x, out_dtype, extra=0.0):
    """Allowed |ours - exact| per output (see the module's docstring); w, x float64."""
    k = w.shape[1]
    exact = F.linear(x, w)
    tol = 4 * math.sqrt(k) * 2**-24 * F.linear(x.abs(), w.abs()) + extra
    if out_dtype == torch.bfloat16:
        tol = tol + 2**-8 * exact.abs()
    return exact, tol


def check(ours, exact, tol):
    err = (ours.double() - exact).abs()
    worst = (err - tol).argmax()
    assert (err <= tol).all(), f"error {err.flatten()[worst]:.3g} > allowed {tol.flatten()[worst]:.3g}"


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_bf16_weights(ops, m, n, k, x_dtype):
    w, x = data(n, k, m, seed=n * k + m)
    w, x = w.bfloat16(), x.to(x_dtype)
    ours = ops.matvec_bf16(x, [w])
    assert ours.shape == (m, n) and ours.dtype == x_dtype
    check(ours, *bound(w.double(), x.double(), x_dtype))


# bf16 x takes AMX tiles where the CPU has them, for matrices of N in whole tiles of 16 rows and K a
# multiple of 32, at least 1024 (csrc/tiles_amx.h); the other shapes above keep to the loops.
TILE_SHAPES = [(1040, 1024), (48, 8192), (16, 2048)]


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", TILE_SHAPES)
def test_bf16_batches_in_tiles_and_in_loops_give_the_product(ops, m, n, k):
    """Both paths of bf16 x, the AMX tiles (where this build and CPU have them) and the AVX-512 or
    other loops, within the bound of the exact product; elsewhere both runs take the same loop."""
    w, x = data(n, k, m, seed=n + k + m)
    w, x = w.bfloat16(), x.bfloat16()
    exact, tol = bound(w.double(), x.double(), x.dtype)
    for tiles in (True, False):
        with amx_tiles(tiles, ops):
            ours = ops.matvec_bf16(x, [w])
        assert ours.shape == (m, n) and ours.dtype == torch.bfloat16
        check(ours, exact, tol)


def test_tiles_take_the_bf16_products_of_any_rows_where_the_cpu_has_amx(ops, kernels):
    """Where the build says AMX, a bf16 product is not the loop's to the last bit (another order of sums),
    for a single row too: a row's sums are the same alone or in a batch, by either path. Without AMX the
    switch changes nothing."""
    w, x = data(2048, 2048, 8, seed=5)
    w, x = w.bfloat16(), x.bfloat16()
    with amx_tiles(True, ops):
        tiles, one = ops.matvec_bf16(x, [w]), ops.matvec_bf16(x[:1], [w])
    with amx_tiles(False, ops):
        loops, one_loop = ops.matvec_bf16(x, [w]), ops.matvec_bf16(x[:1], [w])
    assert torch.equal(one[0], tiles[0]) and torch.equal(one_loop[0], loops[0])
    assert torch.equal(tiles, loops) == torch.equal(one, one_loop) == ("AMX" not in kernels.path)


def x_rounding(wd, x):
    """x rounded to int16 (half a step of max |x[m]| / 32767 per element), through |w|: (m, n)."""
    return wd.abs().sum(1)[None, :] * x.abs().amax(1, keepdim=True) / 65534


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", INT8_SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_int8_weights(ops, kernels, m, n, k, x_dtype):
    w, x = data(n, k, m, seed=n + k + m)
    x = x * torch.linspace(0.1, 3, m)[:, None]  # rows of different ranges: each row has its own int16 scale
    q, scale = quantize_int8(w)
    x = x.to(x_dtype)
    ours = ops.matvec_int8(x, [q], [scale])
    assert ours.shape == (m, n) and ours.dtype == x_dtype
    check(ours, *int8_bound(dequantize_int8(q, scale).double(), x, int8_in_tiles(kernels, [q], x)))


def quantize_int8_groups(w, group):
    """int8 q and fp32 scales (n, k / group) for any group (quantize_int8 takes 64): Q8_0's 32 here."""
    blocks = w.float().unflatten(-1, (-1, group))
    scale = blocks.abs().amax(-1).clamp(min=1e-8) / 127
    return torch.round(blocks / scale[..., None]).clamp(-127, 127).to(torch.int8).flatten(-2), scale


# int8 batches of 3+ rows take the AMX tiles where the build and CPU have them for N in whole tiles of 16,
# K >= 512 and one scale group of 32 or 64 for every matrix; there x is rounded to int8 per group.
INT8_TILE_SHAPES = [(1040, 1024, 64), (48, 8192, 64), (16, 2048, 64), (64, 2048, 32), (960, 576, 64)]


def int8_in_tiles(kernels, ws, x, group=64) -> bool:
    """Whether matvec_int8 takes the AMX tiles for these matrices and x (csrc/matvec.cpp, amx_int8_fits),
    the tiles switched on."""
    return ("AMX" in kernels.path and x.shape[0] >= 3 and x.shape[-1] >= 512 and group in (32, 64)
            and all(w.shape[0] % 16 == 0 for w in ws))


def int8_bound(wd, x, tiles, group=64):
    """The bound of an int8 product: x rounded to int8 per group in the tiles, to int16 per row in the loops."""
    if tiles:
        rounded, either_way = x_in_int8_blocks(x, group)
        return bound(wd, rounded, x.dtype, extra=F.linear(either_way, wd.abs()))
    return bound(wd, x.double(), x.dtype, extra=x_rounding(wd, x.double()))


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k,group", INT8_TILE_SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_int8_batches_in_tiles_and_in_loops_give_the_product(ops, kernels, m, n, k, group, x_dtype):
    """The tiles' product is that of x rounded to int8 per group (and not the loops' int16 rows: the
    bound below tells the two apart); the loops', that of x in int16 rows."""
    w, x = data(n, k, m, seed=n + k + m + group)
    x = (x * torch.linspace(0.1, 3, m)[:, None]).to(x_dtype)
    q, scale = quantize_int8_groups(w, group)
    wd = dequantize_int8(q, scale).double()
    for tiles in (True, False):
        with amx_tiles(tiles, ops):
            ours = ops.matvec_int8(x, [q], [scale])
        assert ours.shape == (m, n) and ours.dtype == x_dtype
        check(ours, *int8_bound(wd, x, tiles and int8_in_tiles(kernels, [q], x, group), group))


def int4_x_roundings(ops, x):
    """For each way this build's int4 kernel rounds x: (int8 x or not, x (float64) as the kernel rounds it
    or as it is, the rounding's bound through |w|: a function of the dequantized w)."""
    ways = [(False, x.double(), lambda wd: x_rounding(wd, x.double()))]
    if has_int8_x(ops):
        rounded, either_way = x_in_int8_blocks(x)
        ways.append((True, rounded, lambda wd: F.linear(either_way, wd.abs())))
    return ways


def int4_reference(packed, scale, offset, x):
    """The exactly dequantized matrix (float64) and the int4 bound's extra E: sum |q s| |x| + |o| |x|."""
    q = unpack_int4(packed).double()  # (n, blocks, 32)
    s, o = scale.double()[..., None], int4_offset(scale, offset).double()[..., None]
    wd = (q * s + o).flatten(1)
    magnitude = (q * s).abs().flatten(1) + o.abs().expand_as(q).flatten(1)
    return wd, F.linear(x.abs(), magnitude)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", INT4_SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [False, True], ids=["q4_1", "q4_0"])
def test_int4_weights(ops, m, n, k, x_dtype, symmetric):
    w, x = data(n, k, m, seed=n + k + m)
    x = (x * torch.linspace(0.1, 3, m)[:, None]).to(x_dtype)
    packed, scale, offset = quantize_int4(w + 0.5)  # offsets of either sign
    offset = None if symmetric else offset
    wd, _ = int4_reference(packed, scale, offset, x.double())
    assert torch.equal(wd.float(), dequantize_int4(packed, scale, offset))
    for int8_x, xr, rounding in int4_x_roundings(ops, x):
        with x_in_int8(int8_x, ops):
            ours = ops.matvec_int4(x, [packed], [scale], [offset])
        assert ours.shape == (m, n) and ours.dtype == x_dtype
        exact, tol = bound(wd, xr, x_dtype, extra=rounding(wd))
        check(ours, exact, tol + 4 * math.sqrt(k) * 2**-24 * int4_reference(packed, scale, offset, xr)[1])


# K of the real models (576: a group of 16 blocks and 2 after it; 1536: 3 groups), odd numbers of blocks (544,
# 96: none in a group) and rows of x read in pieces of K (8224 for several rows).
ROW_SHAPES = [(7, 576), (6, 1536), (5, 544), (4, 96), (3, 8224)]


@pytest.mark.parametrize("n,k", ROW_SHAPES)
def test_a_rows_int4_product_is_the_same_alone_beside_other_rows_and_beside_any_weight_row(ops, n, k):
    """Speculation checks guessed tokens as rows of one step and keeps them only where they equal what one row
    alone gives, so row m of an M-row product must be the 1-row product to the bit, for every way this build
    rounds x (csrc/matvec.cpp). The AVX-512 kernel also takes two weight rows at a time where the rows of x
    allow: a weight row's outputs must not depend on its neighbour either (the matrix without its first row
    pairs every row with its other neighbour)."""
    w, x = data(n, k, MAX_KERNEL_ROWS, seed=n * k)
    x = x * torch.linspace(0.1, 3, MAX_KERNEL_ROWS)[:, None]
    packed, scale, offset = quantize_int4(w + 0.5)
    for int8_x, _, _ in int4_x_roundings(ops, x):
        for o in (offset, None):
            with x_in_int8(int8_x, ops):
                alone = torch.cat([ops.matvec_int4(x[m:m + 1], [packed], [scale], [o]) for m in range(MAX_KERNEL_ROWS)])
                for rows in ROWS:
                    assert torch.equal(ops.matvec_int4(x[:rows], [packed], [scale], [o]), alone[:rows]), (int8_x, rows)
                others = ops.matvec_int4(x, [packed[1:]], [scale[1:]], [None if o is None else o[1:]])
            assert torch.equal(others, alone[:, 1:]), int8_x


@pytest.mark.parametrize("n,k", ROW_SHAPES)
def test_a_rows_int8_product_is_the_same_alone_and_beside_other_rows_in_the_loops(ops, n, k):
    """As for int4, in the loops (the AMX tiles round a batch's x otherwise, by design: LLAMA_DETERMINISTIC
    keeps int8 batches out of them)."""
    w, x = data(n, k, MAX_KERNEL_ROWS, seed=n + k)
    q, scale = quantize_int8(w)
    with amx_tiles(False, ops):
        alone = torch.cat([ops.matvec_int8(x[m:m + 1], [q], [scale]) for m in range(MAX_KERNEL_ROWS)])
        for rows in ROWS:
            assert torch.equal(ops.matvec_int8(x[:rows], [q], [scale]), alone[:rows]), rows


@pytest.mark.parametrize("m", [1, 5, MAX_KERNEL_ROWS])
def test_several_matrices_side_by_side(ops, kernels, m):
    """q|k|v in one call: the outputs of matrices of different N, concatenated along the last axis."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 576, generator=g)
    ws = [torch.randn(n, 576, generator=g).bfloat16() for n in (576, 192, 192)]
    ours = ops.matvec_bf16(x, ws)
    exact, tol = bound(torch.cat(ws).double(), x.double(), x.dtype)
    check(ours, exact, tol)
    qs = [quantize_int8(w.float()) for w in ws]
    ours = ops.matvec_int8(x, [q for q, _ in qs], [s for _, s in qs])
    wd = torch.cat([dequantize_int8(q, s) for q, s in qs]).double()
    check(ours, *int8_bound(wd, x, int8_in_tiles(kernels, [q for q, _ in qs], x)))
    q4 = [quantize_int4(w.float()) for w in ws]
    offsets = [q4[0][2], None, q4[2][2]]  # Q4_1 and Q4_0 matrices in one call
    refs = [int4_reference(p, s, o, x.double()) for (p, s, _), o in zip(q4, offsets)]
    wd = torch.cat([wd for wd, _ in refs])
    for int8_x, xr, rounding in int4_x_roundings(ops, x):
        with x_in_int8(int8_x, ops):
            ours = ops.matvec_int4(x, [p for p, _, _ in q4], [s for _, s, _ in q4], offsets)
        exact, tol = bound(wd, xr, x.dtype, extra=rounding(wd))
        magnitude = torch.cat([int4_reference(p, s, o, xr)[1] for (p, s, _), o in zip(q4, offsets)], dim=-1)
        check(ours, exact, tol + 4 * math.sqrt(576) * 2**-24 * magnitude)


@pytest.mark.parametrize("m", [2, 3, 5, MAX_KERNEL_ROWS])
def test_several_matrices_side_by_side_in_tiles(ops, kernels, m):
    """q|k|v of the 1B shape's layout in one call, where bf16 and int8 batches take the AMX tiles:
    16-row blocks of each matrix, outputs side by side."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 1024, generator=g).bfloat16()
    ws = [torch.randn(n, 1024, generator=g).bfloat16() for n in (1024, 256, 256)]
    exact, tol = bound(torch.cat(ws).double(), x.double(), x.dtype)
    check(ops.matvec_bf16(x, ws), exact, tol)
    qs = [quantize_int8(w.float()) for w in ws]
    wd = torch.cat([dequantize_int8(q, s) for q, s in qs]).double()
    check(ops.matvec_int8(x, [q for q, _ in qs], [s for _, s in qs]),
          *int8_bound(wd, x, int8_in_tiles(kernels, [q for q, _ in qs], x)))


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_any_split_of_the_rows_across_threads_gives_the_same_outputs(ops, threads):
    """Threads take the rows a task at a time and take over the rest of a slower thread's share
    (matvec.cpp, parallel_rows): more threads than cores are taken off their cores all the time, so
    the tasks change hands in every call. Each output is one thread's sum: the same bits as on one
    thread, and none left out (the outputs start uninitialized)."""
    g = torch.Generator().manual_seed(threads)
    x = torch.randn(3, 576, generator=g)
    ws = [torch.randn(n, 576, generator=g) for n in (1003, 192, 2051)]  # tasks across the matrices' seams
    bf16 = [w.bfloat16() for w in ws]
    q8 = [quantize_int8(w) for w in ws]
    q4 = [quantize_int4(w) for w in ws]
    x_tiles = torch.randn(3, 1024, generator=g).bfloat16()
    tiles = [torch.randn(n, 1024, generator=g).bfloat16() for n in (1008, 192, 2048)]
    q8_tiles = [quantize_int8(w.float()) for w in tiles]
    products = {
        "bf16": lambda: ops.matvec_bf16(x, bf16),
        "bf16 tiles": lambda: ops.matvec_bf16(x_tiles, tiles),  # AMX where there is
        "int8 tiles": lambda: ops.matvec_int8(x_tiles, [q for q, _ in q8_tiles], [s for _, s in q8_tiles]),
        "int8": lambda: ops.matvec_int8(x, [q for q, _ in q8], [s for _, s in q8]),
        "int4": lambda: ops.matvec_int4(x, [p for p, _, _ in q4], [s for _, s, _ in q4], [o for _, _, o in q4]),
    }
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {name: product() for name, product in products.items()}
        torch.set_num_threads(threads)
        for _ in range(20):
            for name, product in products.items():
                torch.testing.assert_close(product(), alone[name], rtol=0, atol=0, msg=name)
    finally:
        torch.set_num_threads(before)


def test_one_dimensional_x_gives_one_dimensional_y(ops):
    w, x = data(9, 64, 1, seed=3)
    y = ops.matvec_bf16(x[0], [w.bfloat16()])
    assert y.shape == (9,)
    torch.testing.assert_close(y, ops.matvec_bf16(x, [w.bfloat16()])[0], rtol=0, atol=0)


def test_bad_input_is_refused_with_what_was_expected(ops):
    w = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"x has 9 rows; expected 1 to 8"):
        ops.matvec_bf16(torch.zeros(9, 64), [w])
    with pytest.raises(RuntimeError, match=r"w\[0\] is \[4, 64\] but x has K=65"):
        ops.matvec_bf16(torch.zeros(2, 65), [w])
    with pytest.raises(RuntimeError, match=r"w\[1\] must be a contiguous \(N, K\) CPU tensor of BFloat16; got Float"):
        ops.matvec_bf16(torch.zeros(2, 64), [w, torch.zeros(4, 64)])
    with pytest.raises(RuntimeError, match=r"x must be a contiguous float32 or bfloat16 CPU tensor"):
        ops.matvec_bf16(torch.zeros(64, 2).T, [w])
    q, scale = quantize_int8(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match=r"scale\[0\] must be a contiguous float32 CPU tensor"):
        ops.matvec_int8(torch.zeros(1, 64), [q], [scale.bfloat16()])
    with pytest.raises(RuntimeError, match=r"1 weight matrices but 0 scale tensors"):
        ops.matvec_int8(torch.zeros(1, 64), [q], [])
    packed, scale, offset = quantize_int4(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match=r"w\[0\] is \[4, 32\] \(two weights a byte\) but x has K=32"):
        ops.matvec_int4(torch.zeros(1, 32), [packed], [scale], [offset])
    with pytest.raises(RuntimeError, match=r"K=48 is not a multiple of the block of 32 weights"):
        ops.matvec_int4(torch.zeros(1, 48), [packed[:, :24].contiguous()], [scale], [offset])
    with pytest.raises(RuntimeError, match=r"offset\[0\] must be a contiguous float16 CPU tensor \(N, K / 32\) = "
                                           r"\(4, 2\); got Float"):
        ops.matvec_int4(torch.zeros(1, 64), [packed], [scale], [offset.float()])
    with pytest.raises(RuntimeError, match=r"1 weight matrices, 1 scale tensors and 0 offsets"):
        ops.matvec_int4(torch.zeros(1, 64), [packed], [scale], [])


@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (129, 576), (5, 2048)])
@pytest.mark.parametrize("with_offset", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_int4_gives_the_reference_matrix(ops, n, k, with_offset, dtype):
    packed, scale, offset = quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)))
    offset = offset if with_offset else None  # none: Q4_0's symmetric blocks
    reference = dequantize_int4(packed, scale, offset)  # fp32
    ours = ops.dequantize_int4(packed, scale, offset, dtype)
    assert ours.dtype == dtype and ours.shape == (n, k)
    # fp32: the same up to one multiply-add's rounding; bf16: the reference rounded, give or take one step
    tol = 1e-6 * reference.abs() + 1e-7 if dtype == torch.float32 else 2**-8 * reference.abs() + 1e-7
    assert ((ours.float() - reference).abs() <= tol).all()
    if dtype == torch.bfloat16:  # rounded to nearest: mostly exactly the reference's bf16
        assert (ours == reference.bfloat16()).float().mean() > 0.99


@pytest.mark.parametrize("n,k", [(1, 64), (7, 576), (33, 2048), (3, 96), (2, 5)])  # groups of 64, 64, 64, 48, 5
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_int8_gives_the_reference_matrix(ops, n, k, dtype):
    q, scale = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(k)))
    reference = dequantize_int8(q, scale)
    ours = ops.dequantize_int8(q, scale, dtype)
    assert ours.dtype == dtype and ours.shape == (n, k)
    if dtype == torch.float32:
        assert torch.equal(ours, reference)
    else:
        assert torch.equal(ours, reference.bfloat16())


def test_dequantize_ops_refuse_what_they_cannot_read(ops):
    packed, scale, offset = quantize_int4(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match=r"scale must be contiguous float16 \(4, 2\)"):
        ops.dequantize_int4(packed, scale.float(), offset, torch.float32)
    with pytest.raises(RuntimeError, match=r"to float32 or bfloat16, not Half"):
        ops.dequantize_int4(packed, scale, offset, torch.float16)
    with pytest.raises(RuntimeError, match=r"weights must be contiguous int8"):
        ops.dequantize_int8(packed, scale.float(), torch.float32)


# ---- llama.cpp's blocks (csrc/ggml_blocks.h): the K-quants, Q5_0 and Q5_1 -------------------------------
# Against the gguf library's dequantization of the same bytes (the reference of every GGUF reader). The kernel
# rounds x to int8 per 256 values where K is whole blocks of 256, else per 32 (x_in_int8_blocks), and scales each
# group's (or block's) integer dot product in fp32; the fp32 summation bound is taken with E over |a q| + |a z + m| (weight = a (q - z) - m, the module's
# docstring), what those products round relative to.
# K: one block, several, a K-quant row that is not whole groups of 8 blocks (2304: 9), and rows of x read in
# pieces of K (8448); Q5_0/Q5_1 also on the default model's 576, and on whole blocks of 256 (1024: x rounded per 256).
BLOCK_SHAPES = {256: [(1, 256), (7, 768), (33, 2304), (3, 8448)], 32: [(1, 32), (7, 96), (33, 576), (5, 1024), (3, 8224)]}
# Bytes of each format that hold q (zeroed, a block's weights are its -(a z + m)); the others hold d, dmin, scales
Q_BYTES = {"Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192), "Q3_K": (0, 96), "Q2_K": (16, 80),
           "Q5_0": (2, 22), "Q5_1": (4, 24)}
def gguf_dequantized(blocks: torch.Tensor) -> torch.Tensor:
    f = FORMATS[blocks.shape[2]]
    values = gguf.quants.dequantize(blocks.numpy().reshape(blocks.shape[0], -1), gguf.GGMLQuantizationType[f.name])
    return torch.from_numpy(values)


def blocks_reference(blocks: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantized matrix (float64) and the bound's E: sum |a q| |x| + |a z + m| |x|."""
    first, end = Q_BYTES[FORMATS[blocks.shape[2]].name]
    no_q = blocks.clone()
    no_q[..., first:end] = 0
    wd, bias = gguf_dequantized(blocks).double(), gguf_dequantized(no_q).double()  # bias: -(a z + m) per weight
    return wd, F.linear(x.abs(), (wd - bias).abs() + bias.abs())


@pytest.mark.parametrize("name", list(BY_NAME))
def test_blocks_dequantize_as_the_gguf_library_bit_for_bit(ops, name):
    """Every format, fp16 values of every size (subnormal to the largest, both signs), q of every value: each
    weight equal to the library's float32, bit for bit; in bf16, that float32 rounded."""
    f = BY_NAME[name]
    blocks = random_blocks(name, 37, 4 * max(f.block, 64), seed=len(name) * f.bytes, extremes=True)
    blocks = torch.from_numpy(blocks)
    reference = gguf_dequantized(blocks)
    ours = ops.dequantize_blocks(blocks, torch.float32)
    assert ours.shape == reference.shape and torch.equal(ours.view(torch.int32), reference.view(torch.int32))
    assert torch.equal(ops.dequantize_blocks(blocks, torch.bfloat16), reference.bfloat16())
    broken = blocks.clone()  # a block whose fp16 scale is NaN or infinite (a damaged file): rounded as torch rounds
    d = {"Q6_K": 208, "Q3_K": 108, "Q2_K": 80}.get(name, 0)  # where the block's fp16 d lies
    broken[0, 0, d:d + 2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # NaN
    broken[1, 0, d:d + 2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # +inf
    wide, narrow = ops.dequantize_blocks(broken, torch.float32), ops.dequantize_blocks(broken, torch.bfloat16)
    numbers = ~wide.isnan()  # (a NaN stays a NaN: its bits are c10's 0x7FC0, where torch's own conversion keeps more)
    assert wide.isnan().any() and wide.isinf().any() and torch.equal(narrow.isnan(), wide.isnan())
    assert torch.equal(narrow[numbers].view(torch.int16), wide[numbers].bfloat16().view(torch.int16))


@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("name", list(BY_NAME))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_blocks_weights(ops, m, name, x_dtype):
    for n, k in BLOCK_SHAPES[BY_NAME[name].block]:
        check_blocks_op(ops.matvec_blocks, name, m, n, k, x_dtype, seed=n + k + m)


def check_blocks_op(op, name, m, n, k, x_dtype, seed):
    """op(x, [blocks]) on m rows of x and random blocks of `name` (n, k): within the bound of x rounded to int8 as the
    kernel rounds it (per 256 where K is whole 256s, else per 32), the products summed in int32, the scaled sums in
    fp32; and a row's result the same alone as beside the others."""
    blocks = torch.from_numpy(random_blocks(name, n, k, seed=seed))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * torch.linspace(0.1, 3, m)[:, None]
    x = x.to(x_dtype)
    rounded, either_way = x_in_int8_blocks(x, 256 if k % 256 == 0 else 32)
    wd, magnitude = blocks_reference(blocks, rounded)
    ours = op(x, [blocks])
    assert ours.shape == (m, n) and ours.dtype == x_dtype
    exact, tol = bound(wd, rounded, x_dtype, extra=F.linear(either_way, wd.abs()))
    check(ours, exact, tol + 4 * math.sqrt(k) * 2**-24 * magnitude)
    alone = torch.cat([op(x[i:i + 1].contiguous(), [blocks]) for i in range(m)])
    assert torch.equal(ours, alone)  # a row's result does not depend on the rows beside it


def test_blocks_of_several_formats_side_by_side(ops):
    """A Q4_K_M file's q|k|v: one call over matrices of different formats, as each alone."""
    k = 512
    ws = [torch.from_numpy(random_blocks(name, n, k, seed=n)) for name, n in [("Q4_K", 64), ("Q6_K", 16), ("Q5_0", 16), ("Q2_K", 8)]]
    x = torch.randn(3, k)
    together = ops.matvec_blocks(x, ws, True)
    assert torch.equal(together, torch.cat([ops.matvec_blocks(x, [w], True) for w in ws], dim=1))


# Prefill's products (csrc/prefill_blocks.cpp): K of one block and more (2304: 9 blocks of 256; 576 and 1024 for the
# formats of 32), N past whole tiles of 8 and 16 rows, and 19 rows of x (past whole groups of 4 and of 8).
PREFILL_SHAPES = {256: [(33, 256), (16, 2304)], 32: [(33, 576), (7, 1024)]}


@pytest.mark.parametrize("name", list(BY_NAME))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_blocks_prefill_products(ops, kernels, name, x_dtype):
    """Many rows of x through prefill_blocks: within the decode kernel's bound (x rounded to int8 as it rounds it, the
    products summed in int32, the scaled sums in fp32), outputs side by side for several matrices, and a row's result
    the same alone as beside others."""
    if kernels.path == "portable":
        assert not hasattr(ops, "prefill_blocks")  # model/linear.py widens the blocks for F.linear there
        return
    m = 19
    for n, k in PREFILL_SHAPES[BY_NAME[name].block]:
        check_blocks_op(ops.prefill_blocks, name, m, n, k, x_dtype, seed=n + k)
    ws = [torch.from_numpy(random_blocks(kind, n, 512, seed=n)) for kind, n in [("Q4_K", 40), ("Q6_K", 8), ("Q2_K", 3)]]
    x = torch.randn(m, 512)
    assert torch.equal(ops.prefill_blocks(x, ws), torch.cat([ops.prefill_blocks(x, [w]) for w in ws], dim=1))
    wide = ops.prefill_blocks(x.bfloat16(), ws, True)  # fp32_out: the fp32 sums, not rounded to x's bf16
    assert wide.dtype == torch.float32 and torch.equal(wide.bfloat16(), ops.prefill_blocks(x.bfloat16(), ws))
    assert not torch.equal(wide, wide.bfloat16().float())


def test_blocks_that_are_not_a_format_are_refused(ops):
    with pytest.raises(RuntimeError, match=r"w\[0\] must be a contiguous uint8 CPU tensor \(N, K / block, bytes\) "
                                           r"of a block format .*; got Byte \[4, 2, 143\]"):
        ops.matvec_blocks(torch.zeros(1, 512), [torch.zeros(4, 2, 143, dtype=torch.uint8)])
    with pytest.raises(RuntimeError, match=r"w\[0\] holds 2 Q4_K blocks a row \(512 weights\) but x has K=256"):
        ops.matvec_blocks(torch.zeros(1, 256), [torch.from_numpy(random_blocks("Q4_K", 4, 512, seed=0))])
    with pytest.raises(RuntimeError, match=r"dequantize_blocks: weights must be contiguous uint8 \(N, K / block, "
                                           r"bytes\) of a block format"):
        ops.dequantize_blocks(torch.zeros(4, 2, 143, dtype=torch.uint8), torch.float32)
    if hasattr(ops, "prefill_blocks"):
        q4_k = torch.from_numpy(random_blocks("Q4_K", 4, 512, seed=0))
        with pytest.raises(RuntimeError, match=r"prefill_blocks: w\[0\] holds 2 Q4_K blocks a row \(512 weights\)"):
            ops.prefill_blocks(torch.zeros(20, 256), [q4_k])
        with pytest.raises(RuntimeError, match=r"prefill_blocks: x must be a contiguous float32 or bfloat16 CPU"):
            ops.prefill_blocks(torch.zeros(512), [q4_k])
        with pytest.raises(RuntimeError, match=r"prefill_blocks: w\[1\] must be a contiguous uint8 CPU tensor"):
            ops.prefill_blocks(torch.zeros(20, 512), [q4_k, torch.zeros(4, 2, 143, dtype=torch.uint8)])


def test_build_folder_is_keyed_by_sources_flags_and_cpu_not_by_the_checkout(tmp_path, monkeypatch):
    copy = tmp_path / "elsewhere" / "csrc"
    shutil.copytree(CSRC, copy)
    assert build_folder("native", copy) == build_folder("native")  # another checkout of the same code
    assert build_folder("znver3") != build_folder("native")
    header = copy / "dot_avx2.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert build_folder("native", copy) != build_folder("native")
    folder = build_folder("native")
    monkeypatch.setattr(model.kernels, "cpu_tag", lambda: "another-cpu")
    assert build_folder("native") != folder


def test_weights_are_prefetched_into_l2_only_on_intel_cpus(monkeypatch):
    from model.kernels import cflags

    for intel in (True, False):
        monkeypatch.setattr(model.kernels, "is_intel", lambda: intel)
        assert ("-DLLAMA_PREFETCH_L2" in cflags("native")) == intel
        assert "-march=native" in cflags("native")
    on_amd = build_folder("native")
    monkeypatch.setattr(model.kernels, "is_intel", lambda: True)
    assert build_folder("native") != on_amd  # the define is part of the build's key


def test_cpu_vendor_is_read_from_cpuinfo():
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    assert cpu.is_intel() == ("GenuineIntel" in text.split("\n\n")[0])


def test_another_checkout_loads_the_cached_build_without_compiling(tmp_path):
    """The first reply of a fresh checkout must not compile: its build is found by the hash."""
    native = build("native")
    shutil.copytree(Path(model.__file__).parent, tmp_path / "model", ignore=shutil.ignore_patterns("__pycache__"))
    script = """
import torch.utils.cpp_extension
def refuse(*args, **kwargs):
    raise AssertionError("compiled again")
torch.utils.cpp_extension.load = refuse
from model.kernels import build
b = build("native")
print(b.folder, b.path, sep="\\n")
"""
    marked = time.time()
    month_ago = marked - 31 * 86400
    os.utime(native.folder, (month_ago, month_ago))  # as if unused for a month: loading it marks it used again
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=os.environ | {"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == [str(native.folder), native.path]
    assert native.folder.stat().st_mtime >= marked - 1


def test_builds_no_process_loaded_for_a_month_are_removed_and_the_others_kept(tmp_path):
    """The cache folder of kernel builds does not grow with every version of the code: a build loaded marks itself
    used, and those unused for UNUSED_DAYS go then (with the folders of compiles that never finished), but not
    one whose lock another process holds, nor the one being loaded, nor what is not a build."""
    kernels = tmp_path / "kernels"
    month_ago = time.time() - (model.kernels.UNUSED_DAYS + 1) * 86400
    names = {"stale": "llama_kernels_native-00000000", "stale scratch": "llama_kernels_znver3-11111111.tmp-4242",
             "recent": "llama_kernels_znver3-22222222", "held": "llama_kernels_x86_64-33333333",
             "loading": "llama_kernels_native-44444444", "not a build": "notes"}
    for key, name in names.items():
        (kernels / name).mkdir(parents=True)
        (kernels / name / "library.so").write_bytes(b"\0" * 100)
        (kernels / f"{name}.lock").touch()
        if key != "recent":
            os.utime(kernels / name, (month_ago, month_ago))
    with open(kernels / f"{names['held']}.lock", "a") as held:  # as another process compiling or loading it
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = model.kernels._prune(kernels, keep=kernels / names["loading"])
    assert sorted(removed) == sorted([names["stale"], names["stale scratch"]])
    left = {name for key, name in names.items() if not key.startswith("stale")}
    assert {p.name for p in kernels.iterdir() if p.is_dir()} == left
    assert (kernels / f"{names['stale']}.lock").exists() is False and (kernels / f"{names['held']}.lock").exists()
    assert model.kernels._prune(tmp_path / "no such folder", keep=kernels) == []


def test_decode_path_says_which_code_runs_or_why_not():
    with configured():
        assert decode_path() == native_path()
    with configured(march="x86-64"):
        assert decode_path() == "portable (-march=x86-64)"
    with configured(march="no-such-cpu"):
        reason = decode_path()
        assert reason.startswith("F.linear (no kernel: building ") and "-march=no-such-cpu" in reason, reason
        assert model.kernels.kernels() is None
    with configured(enabled=False):
        assert decode_path() == "F.linear (kernel off)"


def test_the_kernel_turned_off_is_off():
    with configured():
        assert model.kernels.kernels() is not None  # built: this machine has a compiler
    with configured(enabled=False):
        assert model.kernels.kernels() is None  # every product through F.linear, decode steps op by op


def test_loading_a_checkpoint_builds_the_kernel_and_logs_its_path(tmp_path, caplog):
    hf_model(seed=1).save_pretrained(tmp_path)
    caplog.set_level(logging.INFO, logger="model.checkpoint")
    with configured():
        load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert f"decode kernel: {native_path()}" in caplog.messages
