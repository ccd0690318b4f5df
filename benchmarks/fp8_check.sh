#!/usr/bin/env bash
# FP8 on one GPU (H100/H200), in calls that each fit a 10-minute limit:
#   bash benchmarks/fp8_check.sh        # GPU tests, 8b W1 bf16 vs fp8 vs fp8-kv, quality table
#   bash benchmarks/fp8_check.sh w3     # 8b W3 bf16 vs fp8 vs fp8-kv
# main: at most 150 + 270 + 90 s (tests, the three W1 runs at ~1 min each, quality).
# Logs and tables go to $OUT (default /tmp/out); the summary table is printed last.
set -u
phase=${1:-main}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 BATCHGEN_HOME=${BATCHGEN_HOME:-/tmp/batchgen-home}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import sys, torch, transformers, triton; print(sys.version.split()[0], torch.__version__, transformers.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
bench() {  # workload timeout
  timeout "$2" python3 -m batchgen bench --shape 8b --workload "$1" --systems overlap \
    --precisions bf16,fp8,fp8-kv --results "$OUT/results.md" 2>&1 | tee "$OUT/bench-$1.txt" | tail -14
}
if [ "$phase" = main ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8.py tests/test_fp8_kernels.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.txt"
  bench W1 270
  timeout 90 python3 benchmarks/fp8_quality.py --shape 1b 2>&1 | tee "$OUT/quality.txt" | tail -8
  echo; echo "== summary"
  grep -E "^FAILED|passed|failed" "$OUT/gpu_tests.txt"
  grep -E "^\| batchgen|\[fp8" "$OUT/bench-W1.txt" | grep -v "^  "
  grep -E "^\|" "$OUT/quality.txt" | tail -6
fi
if [ "$phase" = w3 ]; then
  bench W3 500
  echo; echo "== summary"
  grep -E "^\| batchgen|\[fp8" "$OUT/bench-W3.txt" | grep -v "^  "
fi
