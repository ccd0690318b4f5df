#!/usr/bin/env bash
# Profiled jobs on one GPU (8b shape, random weights, the job-path benchmark's 32k tokenizer):
# W1 (1,024 rows) without and with --profile, alternated twice (the recorder's cost), a
# short-output job with many admissions, and W1 with a deliberately small KV cache;
# `batchgen report` on each.
#   bash benchmarks/profile_check.sh        (reports and pictures go to $OUT or /tmp/out)
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 BATCHGEN_HOME=${BATCHGEN_HOME:-/tmp/batchgen-home}
work=${WORK:-/tmp/batchgen-profile}; OUT=${OUT:-/tmp/out}
mkdir -p "$work" "$OUT"
python3 -m batchgen.bench.job_path 8b "$work" w1=1024 small=256:2 short=4096:1
job() {  # name input new-tokens extra-args...
  local name=$1 input=$2 tokens=$3; shift 3
  rm -rf "$work/out-$name"
  python3 -m batchgen run --model "$work/model-8b" --input "$work/$input" --output "$work/out-$name" \
    --max-new-tokens "$tokens" --set sampling.ignore_eos=true --quiet "$@" > "$work/summary-$name.json"
  python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(sys.argv[2], 'gen tok/s', s['generated_tokens_per_s'], 'wall_s', s['wall_s'], 'complete', s['complete'])" "$work/summary-$name.json" "$name"
}
for i in 1 2; do
  job w1-plain-$i w1.parquet 256
  job w1-$i w1.parquet 256 --profile
done
python3 - "$work" <<'PY' | tee "$OUT/overhead.txt"
import json, sys
rate = lambda n: json.load(open(f"{sys.argv[1]}/summary-{n}.json"))["generated_tokens_per_s"]
plain = [rate(f"w1-plain-{i}") for i in (1, 2)]
prof = [rate(f"w1-{i}") for i in (1, 2)]
print(f"W1 1024 rows: plain {plain} profiled {prof}: profiled / plain = {sum(prof) / sum(plain):.4f}")
PY
mv "$work/out-w1-2" "$work/out-w1"
job short short.parquet 16 --profile
job small-kv small.parquet 256 --profile --set runtime.num_kv_blocks=1200
for name in w1 short small-kv; do
  echo "== batchgen report ($name)"
  python3 -m batchgen report "$work/out-$name" --out "$OUT/profile-$name" | tee "$OUT/report-$name.txt"
done
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_profile_device_clock.py 2>&1 | tail -2
