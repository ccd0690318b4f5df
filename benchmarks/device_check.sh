#!/usr/bin/env bash
# One device call: GPU facts, kernel checks and timings, GPU tests, then batchgen benchmarks.
#   bash benchmarks/device_check.sh PHASE   (PHASE: check | bench | full)
# Logs and the results table go to $OUT (the device tool brings them back).
set -u
phase=${1:-check}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BATCHGEN_HOME=/tmp/batchgen-home
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
if [ "$phase" = final ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
fi
if [ "$phase" = check ] || [ "$phase" = full ]; then
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
  timeout 150 python3 benchmarks/kernels_gpu.py --quick 2>&1 | tee "$OUT/kernels.txt" | tail -30
  timeout 120 python3 -m batchgen bench --shape 1b --workload W1 --systems overlap,sync --results "$OUT/results.md" 2>&1 | tail -14
fi
if [ "$phase" = confirm ]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
  timeout 100 python3 -m batchgen bench --shape 1b --workload W1 --systems overlap,sync --results "$OUT/results.md" 2>&1 | tail -12
  timeout 100 python3 -m batchgen bench --shape 8b --workload W1 --systems overlap --results "$OUT/results.md" 2>&1 | tail -8
fi
if [ "$phase" = verify ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py 2>&1 | tail -12 | tee "$OUT/gpu_tests.txt"
  timeout 100 python3 -m batchgen bench --shape 1b --workload W1 --systems overlap,sync --results "$OUT/results.md" 2>&1 | tail -12
  timeout 120 python3 -m batchgen bench --shape 8b --workload W1 --systems overlap --results "$OUT/results.md" 2>&1 | tail -8
fi
if [ "$phase" = opt ]; then
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
  timeout 200 python3 -m batchgen bench --shape 8b --workload W1 --systems overlap,sync,hf-batch --results "$OUT/results.md" 2>&1 | tail -16
  timeout 100 python3 -m batchgen bench --shape 1b --workload W1 --systems overlap,sync --results "$OUT/results.md" 2>&1 | tail -12
fi
if [ "$phase" = bench ] || [ "$phase" = full ] || [ "$phase" = final ]; then
  timeout 240 python3 -m batchgen bench --shape 8b --workload W1 --systems overlap,sync,hf-static,hf-batch --results "$OUT/results.md" 2>&1 | tail -14
  timeout 150 python3 -m batchgen bench --shape 1b --workload W1 --systems overlap,sync,hf-static,hf-batch --results "$OUT/results.md" 2>&1 | tail -14
  for w in W2 W3 W4; do
    timeout 50 python3 -m batchgen bench --shape 1b --workload $w --systems overlap --results "$OUT/results.md" 2>&1 | tail -6
  done
fi
