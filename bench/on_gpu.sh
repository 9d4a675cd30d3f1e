#!/usr/bin/env bash
# The GPU measurements in one command, for a machine with an NVIDIA GPU, PyTorch with CUDA and transformers
# (pip install -r requirements.txt -r requirements-test.txt gives the rest; a machine without the network takes
# them as wheels: `bench/on_gpu.sh wheels DIR` on one with it fills DIR, `bench/on_gpu.sh run DIR` installs them).
#
#   bench/on_gpu.sh run [WHEELS] [OUT]   tests on the GPU, then bench/speed.py --device cuda; logs and JSON in OUT
#
# What it runs, in order (each step's log in OUT, and it goes on after a failure):
# 1. LLAMA_TEST_DEVICE=cuda pytest over the model and engine tests that compute with a loaded model, the static
#    KV slots' and CUDA graphs' tests (tests/model/test_static_decode.py, tests/engine/test_engine_slots.py) and the
#    packed int8/int4 weights' tests among them.
# 2. bench/speed.py --device cuda on the 1B shape: ours in bf16 with CUDA graphs (the default there), without them,
#    compiled, int8 and int4; transformers in bf16, and with a static cache and torch.compile. The first reply's
#    time to first token (cold_ttft_s in the JSON) against a warm one is item "No slow first reply".
# 3. The same for the default model's shape (launch-bound even more).
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-run}" in
  wheels)  # on a machine with the network: the wheels for Python 3.12 that a bare CUDA image may lack
    dest=${2:?a folder for the wheels}
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
      -d "$dest" msgspec pyzmq llguidance blobfile pycryptodomex gguf bm25s pypdf "llama-models==0.3.0"
    exit ;;
  run) ;;
  *) echo "usage: bench/on_gpu.sh wheels DIR | run [WHEELS] [OUT]" >&2; exit 2 ;;
esac

wheels=${2:-}
out=${3:-${OUT:-bench/results/gpu}}
mkdir -p "$out"
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$wheels"/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"

LLAMA_TEST_DEVICE=cuda timeout 900 python3 -m pytest -q -p no:cacheprovider -x --timeout 300 \
  tests/model/test_static_decode.py tests/engine/test_engine_slots.py tests/model/test_device.py \
  tests/model/test_generate.py tests/model/test_sampling.py tests/engine/test_engine.py \
  $(ls tests/model/test_packed.py 2>/dev/null) 2>&1 | tee "$out/tests.log"

timeout 1200 python3 bench/speed.py --device cuda --shape llama3.2-1b --skip "op by op,fp32,llama.cpp" \
  --decode-repeats 3 2>&1 | tee "$out/speed-1b.log"
cp bench/results/llama3.2-1b.json "$out/" 2>/dev/null
timeout 600 python3 bench/speed.py --device cuda --shape smollm2-135m --only "ours bf16,transformers bf16" \
  --skip "op by op" --decode-repeats 3 2>&1 | tee "$out/speed-default.log"
cp bench/results/smollm2-135m.json "$out/" 2>/dev/null
