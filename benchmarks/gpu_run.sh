#!/usr/bin/env bash
# The GPU check (python -m benchmarks.gpu) as a lent GPU machine runs it, from a copy of this checkout:
#
#   device tool `run`, carry [".whl"], command: bash benchmarks/gpu_run.sh [benchmarks.gpu flags, e.g. --quick]
#
# Such a machine has Python 3.12 with JAX and its CUDA plugin, torch, transformers, flax, orbax and numpy, but
# no network and no gguf, which jaxpaged imports: .whl/ (git-ignored, see benchmarks/README.md) brings its
# wheel. jaxpaged runs from the checkout itself: its subpackages live in the top-level models/, server/ and
# pallas_kernels/, which an install maps into the jaxpaged namespace; where no install provides them (the
# machine's copy), links inside jaxpaged/ do the same, so the code that runs is always the checkout's.
# Results (gpu.json, gpu.png, gpu.log) go to $OUT, which the device tool brings back (else benchmarks/results).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
if ! python3 -c "import gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD"
if ! python3 -c "import jaxpaged.models, jaxpaged.server, jaxpaged.kernels" 2>/dev/null; then
    ln -sfn ../models jaxpaged/models
    ln -sfn ../server jaxpaged/server
    ln -sfn ../pallas_kernels jaxpaged/kernels
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 540 python3 -m benchmarks.gpu --results-dir "$out" "$@" 2>&1 | tee "$out/gpu.log"
