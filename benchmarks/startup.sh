#!/usr/bin/env bash
# Process start -> first row of `batchgen run` on a model folder, first on a machine with empty
# kernel caches (cold), then again (warm: Triton's compiled kernels under $BATCHGEN_HOME).
#   bash benchmarks/startup.sh 1b      # or 8b (writes a 16 GB model folder first)
# The model folder is a random-weight Llama of the shape with the bench's 32k tokenizer.
set -eu
shape=${1:-1b}
export PYTHONPATH=${PYTHONPATH:-$PWD} BATCHGEN_HOME=${BATCHGEN_HOME:-/tmp/batchgen-home}
work=${WORK:-/tmp/batchgen-startup}
mkdir -p "$work"
python3 -m batchgen.bench.job_path "$shape" "$work" prompts=256
rm -rf "$BATCHGEN_HOME/triton"
for run in cold warm; do
  rm -rf "$work/out-$run"
  start=$(date +%s.%N)
  python3 -m batchgen run --model "$work/model-$shape" --input "$work/prompts.parquet" \
    --output "$work/out-$run" --max-new-tokens 16 --quiet > "$work/summary-$run.json"
  end=$(date +%s.%N)
  python3 - "$work/summary-$run.json" "$run" "$start" "$end" <<'PY'
import json, sys
summary = json.load(open(sys.argv[1]))
phases = summary["startup_s"]
total = float(sys.argv[4]) - float(sys.argv[3])
first_row = sum(phases.values())  # the phases run one after another: start -> first row
print(f"{sys.argv[2]}: start -> first row {first_row:.1f} s (process exits at {total:.1f} s); "
      "phases " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
engine = summary.get("engine_startup_s")
if engine:  # the engine's own process, loading while the job's process started
    print("  engine process (its own, overlapping): "
          + ", ".join(f"{k} {v:.2f}" for k, v in engine.items()))
PY
done
