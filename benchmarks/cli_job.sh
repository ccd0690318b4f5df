#!/usr/bin/env bash
# A job through the command line against the engine alone, on the same prompts: the bench's
# job path first (`batchgen bench --job`: the engine alone and the job paths in one process,
# every graph captured before the clock starts), then `batchgen run` on the same model folder
# and text prompts with each graph-capture setting, alternating.
#   bash benchmarks/cli_job.sh 8b 1024 256     # shape, rows, new tokens (8b writes 16 GB)
# Generated tok/s of a run: summary.json's generated tokens over its wall_s (from the engine's
# readiness to the final file); "process s": the command's whole time, start-up included.
set -eu
shape=${1:-1b} rows=${2:-2048} new=${3:-256}
export PYTHONPATH=${PYTHONPATH:-$PWD} BATCHGEN_HOME=${BATCHGEN_HOME:-/tmp/batchgen-home}
work=${WORK:-/tmp/batchgen-cli-job}
mkdir -p "$work"
python3 -m batchgen bench --shape "$shape" --job "$rows" --new-tokens "$new" | grep -E '^\|'
python3 -m batchgen.bench.job_path "$shape" "$work" "prompts=$rows"
for capture in first_use startup first_use startup; do
  rm -rf "$work/out"
  start=$(date +%s.%N)
  python3 -m batchgen run --model "$work/model-$shape" --input "$work/prompts.parquet" \
    --output "$work/out" --max-new-tokens "$new" --set sampling.ignore_eos=true \
    --set "runtime.cuda_graph_capture='$capture'" --quiet > "$work/summary.json"
  end=$(date +%s.%N)
  python3 - "$work/summary.json" "$capture" "$start" "$end" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"batchgen run, graphs captured {sys.argv[2]}: {s['generated_tokens'] / s['wall_s']:,.0f} "
      f"generated tok/s (wall_s {s['wall_s']:.2f}), process s "
      f"{float(sys.argv[4]) - float(sys.argv[3]):.1f}, rows {s['rows_ok']} ok / "
      f"{s['rows_error']} errors")
PY
done
