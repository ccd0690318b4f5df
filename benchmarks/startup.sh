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
python3 - "$shape" "$work" <<'PY'
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.bench import job_path
from batchgen.bench.workloads import SHAPES
from batchgen.models.tiny import batchgen_home

shape, work = sys.argv[1], Path(sys.argv[2])
folder = work / f"model-{shape}"
tokenizer = job_path.bench_tokenizer(batchgen_home())
if not (folder / "config.json").is_file():
    model = job_path.build_model(SHAPES[shape], tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
texts = job_path.text_prompts(tokenizer, 256, (128, 512))
pq.write_table(pa.table({"prompt": texts}), work / "prompts.parquet")
PY
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
print(f"{sys.argv[2]}: process {total:.1f} s; phases " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
PY
done
