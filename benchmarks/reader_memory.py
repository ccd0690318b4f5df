"""Peak memory of streaming a large input through open_input (a check, not a timed test).

    .venv/bin/python benchmarks/reader_memory.py [--rows 2000000]

Writes a Parquet file and a JSONL file of `rows` rows (id, ~100-char prompt) to a temp folder,
then streams each through `open_input(...).batches()`. Every phase runs in a fresh subprocess,
so its ru_maxrss (a process's lifetime peak) measures that phase alone; "baseline" is a
process that only imports batchgen.io.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT_CHARS = 100
VOCAB_SIZE = 2000
SEED = 0
WIDTHS = (10, 12, 8, 9, 12, 14)  # table columns after the first


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def write_inputs(folder: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(SEED)
    vocab = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9)))
        for _ in range(VOCAB_SIZE)
    ]
    prompts = [" ".join(rng.choices(vocab, k=20))[:PROMPT_CHARS] for _ in range(rows)]
    ids = [f"row-{i}" for i in range(rows)]
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), folder / "data.parquet")
    with (folder / "data.jsonl").open("w") as f:
        for row_id, prompt in zip(ids, prompts, strict=True):
            f.write(json.dumps({"id": row_id, "prompt": prompt}) + "\n")


def stream(path: Path) -> dict[str, float]:
    from batchgen.io import InputConfig, open_input

    start = time.perf_counter()
    source = open_input(InputConfig(str(path)))
    opened = time.perf_counter() - start
    count = sum(len(batch) for batch in source.batches())
    assert count == source.num_rows, (count, source.num_rows)
    seconds = time.perf_counter() - start
    return {"rows": count, "open_s": opened, "total_s": seconds, "rows_per_s": count / seconds}


def phase(name: str, folder: Path, rows: int) -> None:
    """Child process: run one phase and print a JSON result line."""
    result: dict[str, float] = {}
    if name == "write":
        write_inputs(folder, rows)
    elif name == "baseline":
        import batchgen.io  # noqa: F401
    else:
        result = stream(folder / f"data.{name}")
    print(json.dumps({**result, "peak_rss_mib": peak_rss_mib()}))


def run_phase(name: str, folder: Path, rows: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--phase", name, "--dir", str(folder), "--rows", str(rows)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        phase(args.phase, args.dir, args.rows)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        run_phase("write", folder, args.rows)
        base = run_phase("baseline", folder, args.rows)
        print(
            f"rows: {args.rows:,}; baseline peak RSS (imports only): {base['peak_rss_mib']:.0f} MiB"
        )
        header = ("input", "file MiB", "rows", "open s", "total s", "rows/s", "peak RSS MiB")
        print(
            f"{header[0]:<10}"
            + "".join(f"{h:>{w}}" for h, w in zip(header[1:], WIDTHS, strict=True))
        )
        for fmt in ("parquet", "jsonl"):
            r = run_phase(fmt, folder, args.rows)
            size = (folder / f"data.{fmt}").stat().st_size / 2**20
            print(
                f"{fmt:<10}{size:>10.1f}{r['rows']:>12,}{r['open_s']:>8.2f}{r['total_s']:>9.2f}"
                f"{r['rows_per_s']:>12,.0f}{r['peak_rss_mib']:>14.0f}"
            )


if __name__ == "__main__":
    main()
