"""The model on a GPU (CUDA, or Apple's MPS) against transformers and against itself on the CPU: where the
weights land and how much device memory loading takes, logits in every checkpoint format, bf16,
int8/int4 weights, replies with a KV cache, batched decode steps, seeded sampling, JSON replies.

Run on the machine's GPU with `LLAMA_TEST_DEVICE=cuda` (tests/conftest.py's `device`); on a machine
without one, every test here is skipped (the CPU runs the same code in the other test modules).
"""

from __future__ import annotations

import json

import pytest
import torch
from support.checkpoints import ROPE, VOCAB, hf_model, prompt_ids, write_meta, write_tiny_checkpoint
from support.gguf_checkpoints import write_llama3_gguf

from model import KVCache, generate, load_checkpoint
from model.convert.gguf import convert_gguf
from model.generation import PREFILL_CHUNK
from model.packed import packed_kinds
from model.sampling import Sampler, SamplingParams
from model.structured import JsonConstraint


@pytest.fixture(scope="module")
def gpu(device):
    """The test device where it is a GPU; else the machine's GPU if it has one; else skip."""
    if device.type != "cpu":
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    pytest.skip("no GPU here (CUDA or MPS): these tests run where one is")


def close(ours: torch.Tensor, theirs: torch.Tensor, tolerance: float) -> bool:
    """Whether ours (any device) is within tolerance x the largest |value| of theirs, everywhere."""
    ours, theirs = ours.float().cpu(), theirs.float().cpu()
    return (ours - theirs).abs().max().item() <= tolerance * theirs.abs().max().item()


def weights_bytes(model) -> int:
    return sum(t.nbytes for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


def test_weights_load_onto_the_gpu_once(hf_folder, gpu):
    """One copy of the weights at any moment: each tensor is moved, never built twice. With the decode steps'
    CUDA graphs (the default on CUDA) the load holds, besides, the static KV slots and each graph's logits."""
    if gpu.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32, device=gpu, graphs=False)
    tensors = [*ckpt.model.parameters(), *ckpt.model.buffers(), ckpt.model.rope.cos, ckpt.model.rope.sin]
    assert {t.device.type for t in tensors} == {gpu.type} and ckpt.device.type == gpu.type
    if gpu.type != "cuda":
        return
    held, peak = torch.cuda.memory_allocated() - before, torch.cuda.max_memory_allocated() - before
    weights = weights_bytes(ckpt.model)
    rope = ckpt.model.rope.cos.nbytes + ckpt.model.rope.sin.nbytes
    assert weights <= held <= weights + rope + 2**20
    assert peak <= weights + rope + ckpt.model.tok_embeddings.weight.nbytes + 2**20
    del ckpt, tensors
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32, device=gpu)
    static = ckpt.model.static
    extra = torch.cuda.memory_allocated() - before - weights - rope
    slots = static.cache.k.nbytes + static.cache.v.nbytes
    assert slots <= extra <= slots + static.held_bytes() + 2**20


@pytest.mark.parametrize("fmt", ["hf", "meta", "gguf f32"])
def test_logits_match_transformers_in_every_format(reference, hf_folder, tmp_path, gpu, fmt):
    if fmt == "hf":
        path = hf_folder
    elif fmt == "meta":  # Meta's params.json carries no RoPE factor: 8 below the 3.2 sizes
        reference = hf_model(tie=False, rope=dict(ROPE, factor=8.0), seed=7)
        path = write_meta(reference, tmp_path / "meta")
    else:
        path = convert_gguf(write_llama3_gguf(reference, tmp_path / "tiny.gguf", "f32"), tmp_path / "from-gguf")
    ckpt = load_checkpoint(path, dtype=torch.float32, device=gpu)
    ids = prompt_ids()
    with torch.no_grad():
        theirs = reference(ids).logits
    ours = ckpt.model(ids.to(gpu))
    assert ours.device.type == gpu.type and ours.shape == (2, ids.shape[1], VOCAB)
    assert close(ours, theirs, 3e-5)


def test_bf16_is_the_gpus_default_and_stays_near_fp32(hf_folder, gpu):
    full = load_checkpoint(hf_folder, dtype=torch.float32, device=gpu)
    half = load_checkpoint(hf_folder, device=gpu)
    expected = torch.bfloat16 if gpu.type == "mps" or torch.cuda.is_bf16_supported() else torch.float16
    assert half.model.layers[0].attention.wq.weight.dtype == expected
    ids = prompt_ids(n=32).to(gpu)
    a, b = full.model(ids).float(), half.model(ids).float()
    assert ((a - b).norm() / a.norm()).item() <= 0.04  # bf16 activations: 0.023 on a CPU
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9


def test_a_greedy_reply_is_the_cpus_reply(hf_folder, gpu):
    """Prefill in chunks (a prompt longer than PREFILL_CHUNK), then decode steps with the KV cache."""
    prompt = prompt_ids(n=PREFILL_CHUNK + 40, seed=4)[0].tolist()
    replies = {}
    for where in ("cpu", gpu):
        ckpt = load_checkpoint(hf_folder, dtype=torch.float32, device=where)
        reply = generate(ckpt, prompt, max_new_tokens=40, stop_ids=set())
        list(reply)
        replies[str(where)] = reply.tokens
    assert len(replies["cpu"]) == 40 and replies[str(gpu)] == replies["cpu"]


def test_each_decode_step_is_the_full_forwards_last_position(hf_folder, gpu):
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32, device=gpu)
    ids = prompt_ids(n=24, seed=6)[0].to(gpu)
    cache = KVCache(ckpt.config, 64, device=gpu, dtype=torch.float32)
    ckpt.model(ids[None, :16], kv_cache=cache)
    cache.tokens.extend(ids[:16].tolist())
    for i in range(16, 24):
        step = ckpt.model.decode(ids[i:i + 1], [cache])[0]
        cache.tokens.append(int(ids[i]))
        assert close(step, ckpt.model(ids[None, :i + 1])[0, -1], 1e-5)


def test_a_batched_decode_step_is_each_sequences_step_alone(hf_folder, gpu):
    ckpt = load_checkpoint(hf_folder, dtype=torch.float32, device=gpu)
    prompts = [prompt_ids(n=n, seed=n)[0].tolist() for n in (5, 17, 30)]

    def prefilled(prompt):
        cache = KVCache(ckpt.config, 48, device=gpu, dtype=torch.float32)
        ckpt.model(torch.tensor([prompt], device=gpu), kv_cache=cache)
        cache.tokens.extend(prompt)
        return cache

    tokens = torch.tensor([7, 70, 700], device=gpu)
    together = ckpt.model.decode(tokens, [prefilled(p) for p in prompts])
    for i, prompt in enumerate(prompts):
        alone = ckpt.model.decode(tokens[i:i + 1], [prefilled(prompt)])[0]
        assert close(together[i], alone, 1e-5)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_weights_on_the_gpu_compute_what_the_cpu_computes(hf_folder, gpu, quantize):
    """Unpacked (pack=False): the GPU stores what the CPU stores. Packed, as a GPU loads by default, the
    weights are in the ops' own layouts: tests/model/test_packed.py."""
    on_cpu = load_checkpoint(hf_folder, dtype=torch.float32, quantize=quantize)
    on_gpu = load_checkpoint(hf_folder, dtype=torch.float32, quantize=quantize, device=gpu, pack=False)
    assert on_gpu.model.layers[0].attention.wq.weight.dtype == (torch.int8 if quantize == "int8" else torch.uint8)
    stored, expected = on_gpu.model.state_dict(), on_cpu.model.state_dict()
    assert stored.keys() == expected.keys()
    for name, tensor in expected.items():
        ours = stored[name]
        assert ours.device.type == gpu.type and ours.dtype == tensor.dtype and ours.shape == tensor.shape, name
        if tensor.dtype in (torch.int8, torch.uint8):
            # Each device quantizes alike but for a weight whose w / scale lands within rounding of a half.
            assert (ours.cpu() != tensor).float().mean().item() <= 1e-3, name
        else:
            assert close(ours, tensor, 1e-6), name
    on_cpu.model.load_state_dict({name: tensor.cpu() for name, tensor in stored.items()})  # the GPU's weights
    ids = prompt_ids(n=16)
    assert close(on_gpu.model(ids.to(gpu)), on_cpu.model(ids), 1e-5)
    reply = generate(on_gpu, ids[0].tolist(), max_new_tokens=12, stop_ids=set())
    assert len(list(reply)) > 0 and len(reply.tokens) == 12


def test_quantized_gguf_blocks_stay_quantized_on_the_gpu(reference, tmp_path, gpu):
    path = convert_gguf(write_llama3_gguf(reference, tmp_path / "tiny.gguf", "q4_0"), tmp_path / "from-gguf")
    """The file's Q4_0 blocks as they are (pack=False): the CPU's numbers. By default a GPU with tinygemm repacks
    them once, at load, into its tiles (and never widens them): the blocks' values are kept, tested bit for bit
    in tests/model/test_packed.py."""
    on_cpu = load_checkpoint(path, dtype=torch.float32)
    on_gpu = load_checkpoint(path, dtype=torch.float32, device=gpu, pack=False)
    assert on_gpu.model.layers[0].feed_forward.w1.weight.dtype == torch.uint8
    ids = prompt_ids(n=16)
    assert close(on_gpu.model(ids.to(gpu)), on_cpu.model(ids), 1e-5)
    if "int4" in packed_kinds(gpu):
        packed = load_checkpoint(path, dtype=torch.float32, device=gpu).model.layers[0].feed_forward.w1
        assert packed.weight.dtype == torch.int32 and packed.scale.shape[-1] == 2


def test_seeded_sampling_on_the_gpu_repeats_and_the_seed_matters(hf_folder, gpu):
    ckpt = load_checkpoint(hf_folder, device=gpu)
    prompt = prompt_ids(n=12, seed=9)[0].tolist()

    def reply(seed):
        gen = generate(ckpt, prompt, max_new_tokens=30, temperature=1.0, top_k=50, top_p=0.95, seed=seed,
                       stop_ids=set())
        list(gen)
        return gen.tokens

    first = reply(7)
    assert reply(7) == first and reply(8) != first


def test_penalties_on_the_gpu_are_the_cpus_and_do_not_wait_for_queued_work(gpu):
    """A draw with repetition, frequency and presence penalties gives the CPU's token and, on CUDA, returns while
    work queued before it still runs (its token ids go over from pinned memory: a plain copy would wait for the
    stream, the decode step queued ahead included)."""
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    history = logits.topk(40).indices.tolist()  # the likeliest tokens, so the penalties decide

    def drawn(device):
        sampler = Sampler(params, device=device)
        sampler.accept(history[:20])  # the prompt
        sampler.sample(logits)
        sampler.accept(history[20:])  # generated
        if device.type == "cuda":
            torch.cuda._sleep(1 << 30)  # ~0.5 s of GPU time queued ahead of the draw
        token = sampler.draw(logits.to(device))
        still_running = device.type == "cuda" and not torch.cuda.current_stream().query()
        return int(token), sampler.penalized(logits.to(device)).cpu(), still_running

    cpu_token, cpu_logits, _ = drawn(torch.device("cpu"))
    token, penalized, still_running = drawn(gpu)
    assert token == cpu_token and torch.equal(penalized, cpu_logits)
    assert still_running or gpu.type != "cuda"


def test_a_json_reply_on_the_gpu_parses(tmp_path, gpu):
    ckpt = load_checkpoint(write_tiny_checkpoint(tmp_path / "tiny"), device=gpu)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "r": {"enum": ["red", "green"]}},
              "required": ["ok", "r"], "additionalProperties": False}
    prompt = ckpt.chat_format.encode_dialog([{"role": "user", "content": "Say yes in JSON."}])
    constraint = JsonConstraint(ckpt.tokenizer, schema, vocab_size=ckpt.config.vocab_size, stop_ids=ckpt.stop_ids)
    reply = generate(ckpt, prompt, max_new_tokens=300, constraint=constraint, temperature=1.0, seed=5)
    text = "".join(reply)
    assert reply.finish_reason == "stop", text
    assert set(json.loads(text)) == {"ok", "r"}
