#!/usr/bin/env bash
# Structured outputs on one GPU: the GPU-marked structured test, the host mask fill alone on
# this machine's cores (one shared lexer; lanes; lanes with torch's fill_; 1-16 threads; GIL
# switch interval 5 and 0.1 ms), then W1 8b (1024 rows) with a JSON schema on every row
# against the same token counts unconstrained (ratio of tok/s, target >= 0.9) and the host
# time split per loop step of both runs.
#   bash benchmarks/structured_check.sh        # logs and the table go to $OUT
# Needs llguidance (pip install llguidance) next to batchgen's requirements.
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 BATCHGEN_HOME=${BATCHGEN_HOME:-/tmp/bh}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import llguidance, torch; print('llguidance', llguidance.get_version() if hasattr(llguidance, 'get_version') else '?', 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_structured.py 2>&1 | tail -4 | tee "$OUT/structured_tests.txt"
timeout 240 python3 benchmarks/grammar_fill.py --threads 1 4 8 16 --switch-ms 5 0.1 2>&1 | tail -36 | tee "$OUT/grammar_fill.txt"
timeout 400 python3 benchmarks/structured_check.py 2>&1 | tail -20 | tee "$OUT/structured_bench.txt"
