#!/usr/bin/env bash
# GPU checks and benchmarks, in calls that each fit a 10-minute limit:
#   bash benchmarks/device_check.sh tests   # GPU tests + kernel tests, then 8b W1 (all systems)
#   bash benchmarks/device_check.sh bench   # 1b W1 (all systems), then 1b W2, W3, W4
#   bash benchmarks/device_check.sh job     # the job path against the engine alone
# Logs and the results tables go to $OUT.
set -u
phase=${1:-tests}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BATCHGEN_HOME=/tmp/batchgen-home
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import sys, torch, transformers, triton; print(sys.version.split()[0], torch.__version__, transformers.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
bench() { timeout "$1" python3 -m batchgen bench "${@:2}" --results "$OUT/results.md" 2>&1 | tail -16; }
if [ "$phase" = tests ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py 2>&1 | tail -6 | tee "$OUT/gpu_tests.txt"
  bench 300 --shape 8b --workload W1 --systems overlap,sync,hf-static,hf-batch
fi
if [ "$phase" = job ]; then
  bench 200 --shape 1b --job 2048 --new-tokens 256
  bench 150 --shape 1b --job 8192 --new-tokens 16
  bench 200 --shape 8b --job 1024 --new-tokens 256
fi
if [ "$phase" = bench ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k closed_engine 2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
  bench 200 --shape 1b --workload W1 --systems overlap,sync,hf-static,hf-batch
  for w in W2 W3; do bench 80 --shape 1b --workload $w --systems overlap; done
  bench 120 --shape 1b --workload W4 --systems overlap --prefix-caching both
fi
