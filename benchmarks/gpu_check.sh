#!/usr/bin/env bash
# The checks that need a CUDA machine, as one prepared run (CI never has a GPU).
#
#   bash benchmarks/gpu_check.sh --prepare   # here, with PyPI: wheels the GPU machine lacks -> .whl/
#   bash benchmarks/gpu_check.sh [OUTDIR]     # there: tests and benchmarks, logs in OUTDIR ($OUT or ./gpu-check)
#   GPU_CHECK_PARTS="tests" bash benchmarks/gpu_check.sh   # only some of: tests flash awq (default: all)
#
# One command on the lent machine may run 10 minutes at most: the three parts take up to
# ~4 (tests), 5 (flash, its own timeout) and 4 (awq) minutes, so where time is short run them
# as two commands, e.g. "tests awq" then "flash".
#
# The GPU machine this project is lent has torch (CUDA), Triton and transformers but not
# KVStream's own small dependencies, and reaches no package index: --prepare downloads them
# as CPython 3.12 manylinux wheels into .whl/ (ignored by git, carried with the run). The run:
#   1. the GPU tests: the flash tier's kernel compiled, against eager in float16 / bfloat16 /
#      float32, and a random Llama through the engine (auto must pick flash; greedy tokens
#      equal model.generate's), the GPU <-> pinned-host swap of the KV pool; the AWQ Triton
#      kernel against the reference, AWQ models resident on the GPU and streamed from pinned
#      host memory (logits and the engine's greedy tokens equal to the resident run's);
#   2. benchmarks/flash_attention.py: the flash tier against gathered SDPA per layer call;
#   3. benchmarks/awq_cuda.py: the AWQ kernel against dequant and a dense bf16 matmul, and
#      streaming's tokens/s against the pinned host -> GPU bandwidth limit.
# The embedded SmolLM2 (a 98 MB file) does not travel: its GPU tests skip there.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0
        typing-inspection==0.4.5 python-dotenv==1.2.4 orjson==3.13.0)

if [ "${1:-}" = "--prepare" ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}" || exit 1
    ls .whl
    exit 0
fi

parts=" ${GPU_CHECK_PARTS:-tests flash awq} "
for part in $parts; do
    case "$part" in tests|flash|awq) ;; *) echo "GPU_CHECK_PARTS: unknown part '$part' (tests, flash, awq)" >&2; exit 2 ;; esac
done
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
} 2>&1 | tee "$out/versions.txt"
status=0
if [[ "$parts" == *" tests "* ]]; then
    timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/hf/test_flash_tier.py \
        tests/hf/test_awq_triton.py tests/hf/test_kv_cache.py -rs 2>&1 | tee "$out/tests.txt" || status=1
fi
if [[ "$parts" == *" flash "* ]]; then
    timeout 300 python3 benchmarks/flash_attention.py 2>&1 | tee "$out/flash_attention.txt" || status=1
fi
if [[ "$parts" == *" awq "* ]]; then
    timeout 240 python3 benchmarks/awq_cuda.py 2>&1 | tee "$out/awq_cuda.txt" || status=1
fi
exit $status
