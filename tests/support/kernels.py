"""Switches of the kernel builds, set for a test: the process's kernel options (model.kernels.configure), how
the int4 kernel rounds x (int8 blocks, the AVX-512 and AVX2 builds' default, or int16 rows), and whether bf16 batches
take the AMX tiles."""

import dataclasses
from contextlib import contextmanager

import torch

import model.kernels
from model.kernels import kernels


@contextmanager
def configured(**options):
    """While inside, this process's kernel as model.kernels.configure(**options) sets it; afterwards as it was
    before (as LLAMA_* set it for the tests, conftest.py; not as they are at the end, which a test may have
    changed meanwhile)."""
    before = dataclasses.asdict(model.kernels.configured())
    model.kernels.configure(**options)
    try:
        yield
    finally:
        model.kernels.configure(**before)


@contextmanager
def x_in_int8(on: bool, *builds):
    """While inside, integer weights take x rounded to int8 blocks (on: int4 per block of 32, int8 batches
    in AMX tiles per scale group) or to int16 per row (off) in the kernel builds given (their ops) and in
    the one linears() uses (csrc/matvec.cpp, set_int8_x; the portable build always rounds to
    int16). With int16, one x value rounded the other way moves an output by 1/32767 of the row's largest
    |x| instead of 1/127 of its block's: two paths whose activations differ in the last bits stay close to
    the last bits."""
    ops = [b for b in (*builds, kernels()) if b is not None]
    before = [b.set_int8_x(on) for b in ops]
    try:
        yield
    finally:
        for b, was in zip(reversed(ops), reversed(before)):
            b.set_int8_x(was)


@contextmanager
def amx_tiles(on: bool, ops):
    """While inside, bf16 and int8 products of several rows take AMX tiles where the build and the CPU have them
    (on, the default) or the AVX-512 loop (off) in the build given (csrc/matvec.cpp, set_amx)."""
    before = ops.set_amx(on)
    try:
        yield
    finally:
        ops.set_amx(before)


def has_int8_x(ops) -> bool:
    """Whether this build's kernel can round x to int8 blocks (its setting left as it was)."""
    with x_in_int8(True, ops):
        return ops.set_int8_x(True)  # the setting before: on where the build has it


def x_in_int8_blocks(x, block=32):
    """x (m, k) as the kernel rounds it for int4 weights in the AVX-512 and AVX2 builds (blocks of 32) and for
    int8 weights in AMX tiles (blocks of the weights' scale group) (float64), and per element the step
    by which it may round the other way: per block, q = round(x * (127 / max |x|)) in fp32 (halves to
    even) times the block's scale max |x| / 127; the compiler may compute 127 / max |x| as
    127 * (1 / max |x|), so a value within 1e-4 of a step of halfway may go either way."""
    blocks = x.float().unflatten(-1, (-1, block))  # (m, k / block, block)
    x_max = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(x_max > 0, 127 / x_max, torch.zeros_like(x_max))
    steps = blocks * inv
    step = (x_max / 127).double()
    either_way = ((steps - steps.floor() - 0.5).abs() < 1e-4).double() * step
    return (torch.round(steps).double() * step).flatten(-2), either_way.flatten(-2)
