#!/usr/bin/env bash
# Data-parallel job path on the GPUs of one machine: 1 rank against 2 ranks on the same text
# Parquet (the 8b shape, W1 prompt lengths, 256 new tokens), then a rank killed mid-run and the
# rerun on another number of ranks.   bash benchmarks/dp_check.sh [ROWS]
set -u
rows=${1:-1024}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 BATCHGEN_HOME=${BATCHGEN_HOME:-/tmp/batchgen-home}
work=${WORK:-/tmp/batchgen-dp}
mkdir -p "$work"
python3 -m batchgen.bench.job_path 8b "$work" prompts="$rows"
args=(--model "$work/model-8b" --input "$work/prompts.parquet" --max-new-tokens 256
      --set sampling.ignore_eos=true --quiet)
report() {  # summary.json -> one line
  python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(sys.argv[2], 'ranks:', s.get('world_size', 1), 'rows', s['rows_ok'], 'gen tok/s', s['generated_tokens_per_s'], 'wall_s', s['wall_s'], 'complete', s['complete'], 'startup', s['startup_s'])" "$1/summary.json" "$2"
}
for n in 1 2; do
  rm -rf "$work/out-$n"
  start=$(date +%s.%N)
  if [ $n = 1 ]; then ranks=(); else ranks=(--gpus $n); fi
  python3 -m batchgen run "${args[@]}" --output "$work/out-$n" "${ranks[@]}" > /dev/null
  echo "exit $? process $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s"
  report "$work/out-$n" "throughput"
done
[ "${KILL:-1}" = 0 ] && exit 0
# kill rank 1 once both ranks have committed a shard; the rerun on 1 rank finishes the rest
out="$work/out-kill"; rm -rf "$out"
python3 -m batchgen run "${args[@]}" --output "$out" --gpus 2 --set output.shard_rows=64 \
  --set runtime.heartbeat_timeout_s=20 > "$work/kill.log" 2>&1 &
launcher=$!
for _ in $(seq 600); do
  ls "$out"/shards/part-*-r1-* > /dev/null 2>&1 && ls "$out"/shards/part-*-r0-* > /dev/null 2>&1 && break
  sleep 0.5
done
victim=$(ls "$out"/shards/part-*-r1-* | head -1 | sed -E 's/.*part-[^-]+-([0-9]+)-r1-.*/\1/')
killed=$(date +%s.%N); kill -9 "$victim"; echo "killed rank 1 (pid $victim)"
wait $launcher; rc=$?
echo "launcher exit $rc, $(python3 -c "print(round($(date +%s.%N) - $killed, 1))") s after the kill; last lines:"
tail -2 "$work/kill.log"
python3 -m batchgen run "${args[@]}" --output "$out" > /dev/null; echo "rerun on 1 rank: exit $?"
report "$out" "after the kill"
python3 - "$out" "$rows" <<'PY'
import sys
import pyarrow.parquet as pq
table = pq.read_table(f"{sys.argv[1]}/results.parquet", columns=["index"])
index = table.column("index").to_pylist()
print("exactly once:", sorted(index) == list(range(int(sys.argv[2]))), len(index), "rows")
PY
