#!/usr/bin/env bash
# The GPU check in one command, for a bare machine with an NVIDIA GPU, PyTorch with CUDA and transformers but
# no network and none of our other dependencies; under 9 minutes in all, each step with its own time limit,
# going on after a failure. Logs, each step's JSON and summary.json in OUT.
#
#   bench/on_gpu.sh wheels [DIR]            on a machine with the network: the wheels a bare image lacks, into
#                                           DIR (default bench/gpu_wheels, git-ignored: carry it to the GPU)
#   bench/on_gpu.sh run [WHEELS] [OUT]      on the GPU machine (WHEELS default bench/gpu_wheels when present)
#   bench/on_gpu.sh run --dry-run [OUT]     the same steps on the CPU, small (tests/test_on_gpu_script.py)
#
# Steps (limit in seconds):
#   versions   20   GPU, driver, torch, CUDA, cuDNN, Triton
#   install    40   the wheels, into a folder on PYTHONPATH
#   tests     150   LLAMA_TEST_DEVICE=cuda pytest over the GPU tests (junit XML: passed, failed, skipped)
#   check-1b  220   bench/gpu_check.py on the Llama 3.2 1B shape: load time, profile of the step's replays, one
#                   stream through generate, 8 streams in slots, 8 requests through the app's engine, for bf16,
#                   int8 and int4 weights and a GGUF's Q4_K blocks (the first run also writes the shape's random
#                   checkpoints)
#   check-default 40  the same on the default model's shape (SmolLM2-135M), bf16 and int4
#   transformers 60   bench/speed.py's transformers rows (eager; static cache + torch.compile), for the ratios
set -uo pipefail
cd "$(dirname "$0")/.."

GPU_TESTS=(tests/model/test_packed.py tests/model/test_device.py tests/model/test_static_decode.py
           tests/engine/test_engine_slots.py tests/model/test_step_ops.py tests/model/test_generate.py
           tests/model/test_sampling.py)  # most telling first: a run cut by its limit keeps their lines
BINARY=(msgspec pyzmq llguidance tiktoken rpds-py)
PURE=(gguf bm25s pypdf "llama-models==0.3.0" pytest pytest-timeout pluggy iniconfig hypothesis sortedcontainers
      jsonschema jsonschema-specifications referencing attrs)

case "${1:-}" in
  wheels)
    dest=${2:-bench/gpu_wheels}
    mkdir -p "$dest"
    for version in 3.10 3.11 3.12 3.13; do  # the image's Python is not known ahead
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$dest" "${BINARY[@]}" || exit 1
    done
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$dest" "${PURE[@]}" || exit 1
    du -sh "$dest"
    exit ;;
  run) ;;
  *) echo "usage: bench/on_gpu.sh wheels [DIR] | run [--dry-run | WHEELS] [OUT]" >&2; exit 2 ;;
esac

dry=0
if [ "${2:-}" = "--dry-run" ]; then
  dry=1; wheels=""; out=${3:-${OUT:-bench/results/gpu-dry-run}}
else
  wheels=${2:-}; [ -z "$wheels" ] && [ -d bench/gpu_wheels ] && wheels=bench/gpu_wheels
  out=${3:-${OUT:-bench/results/gpu}}
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1
steps="$out/steps.tsv"
: > "$steps"

step() {  # step NAME LIMIT COMMAND...: run it under its limit, log in OUT/NAME.log, its exit status and time kept
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=5 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >> "$steps"
  tail -n 4 "$out/$name.log"
  echo "== $name: exit $rc in $((SECONDS - start))s"
}

step versions 20 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  python3 -c "import sys, torch; print(\"python\", sys.version.split()[0]); print(\"torch\", torch.__version__,
  \"cuda\", torch.version.cuda, \"cudnn\", torch.backends.cudnn.version(), \"gpu\",
  torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  python3 -c "import triton; print(\"triton\", triton.__version__)" 2>&1 || true'

# Its own scratch folders go when it ends, however it ends (a dry run is a test of the suite: it must not leave
# a quarter GB in /tmp at each run).
site=""; tiny=""
trap 'rm -rf ${site:+"$site"} ${tiny:+"$tiny" "$tiny-q4_k"}' EXIT
if [ -n "$wheels" ]; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/llama-chat-site.XXXX")
  names=$(printf '%s\n' "${BINARY[@]}" "${PURE[@]}" | sed 's/==.*//')
  step install 40 python3 -m pip install -q --no-index --no-deps --find-links "$wheels" --target "$site" $names
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

# The tests in one process (-n 0): pytest.ini's workers would each start torch (and a CUDA context) for a few tests.
if [ $dry = 1 ]; then  # the same steps on the CPU: a few tests, a tiny checkpoint, no transformers rows
  step tests 150 python3 -m pytest -v -n 0 -p no:cacheprovider --timeout 90 --junitxml "$out/tests.xml" \
    tests/model/test_step_ops.py -k "silu or power_of_two"
  tiny=$(mktemp -d "${TMPDIR:-/tmp}/llama-chat-tiny.XXXX")
  python3 -c "import sys; sys.path.insert(0, 'tests'); from support.checkpoints import hf_model
hf_model(num_hidden_layers=2, hidden_size=256, intermediate_size=512).save_pretrained('$tiny')" > /dev/null 2>&1
  step check-1b 170 python3 bench/gpu_check.py --dry-run --checkpoint "$tiny" --kinds bf16,int8,int4,q4_k \
    --out "$out/check-1b.json"
else
  step tests 150 env LLAMA_TEST_DEVICE=cuda python3 -m pytest -v -n 0 -p no:cacheprovider --timeout 90 \
    --junitxml "$out/tests.xml" "${GPU_TESTS[@]}"
  step check-1b 220 python3 bench/gpu_check.py --shape llama3.2-1b --kinds bf16,int8,int4,q4_k --out "$out/check-1b.json"
  step check-default 40 python3 bench/gpu_check.py --shape smollm2-135m --kinds bf16,int4 \
    --out "$out/check-default.json"
  step transformers 60 python3 bench/speed.py --device cuda --shape llama3.2-1b --only "transformers bf16" \
    --new-tokens 64 --decode-repeats 1 --no-chart --budget 25
  cp bench/results/llama3.2-1b.json "$out/speed-1b.json" 2>/dev/null
fi

python3 - "$out" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
summary = {"steps": {}}
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, seconds, limit = line.split("\t")
    summary["steps"][name] = {"exit": int(rc), "seconds": int(seconds), "limit": int(limit),
                              "timed_out": int(rc) in (124, 137)}
if (out / "tests.xml").is_file():
    suite = ET.parse(out / "tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    summary["tests"] = counts | {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
                                 "failed": failed}
elif (out / "tests.log").is_file():  # cut by its limit: each test's line as -v printed it
    lines = (out / "tests.log").read_text(errors="replace").splitlines()
    summary["tests"] = {"cut": True, "passed": sum(" PASSED" in line for line in lines),
                        "failed": [line.split(" ")[0] for line in lines if " FAILED" in line or " ERROR" in line]}
for name in ("check-1b", "check-default"):
    if (out / f"{name}.json").is_file():
        summary[name] = json.loads((out / f"{name}.json").read_text())
summary["seconds"] = sum(s["seconds"] for s in summary["steps"].values())
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({"steps": summary["steps"], "tests": summary.get("tests"), "seconds": summary["seconds"]}, indent=1))
EOF
