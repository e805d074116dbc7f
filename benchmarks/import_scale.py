"""How long ``pace import table`` takes and how much memory it holds on a large step table, and how long
``pace diagnose`` then takes on the record: a synthetic table (each rank's compute log-normal around
100 ms, one rank 20% slower), written as Parquet (or CSV), imported into an Arrow record in a child
process whose peak resident memory is read back. Not a test; prints what it measured.

    python benchmarks/import_scale.py [--steps 100000] [--ranks 1024] [--csv] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def write_table(path: Path, steps: int, ranks: int, csv: bool) -> None:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    writer = None
    block = max(1, 2_000_000 // ranks)  # steps per written batch
    for lo in range(0, steps, block):
        n = min(block, steps - lo)
        compute = 100.0 * rng.lognormal(0.0, 0.03, (n, ranks))
        compute[:, ranks // 2] *= 1.2
        table = pa.table(
            {
                "rank": np.tile(np.arange(ranks, dtype=np.int32), n),
                "step": np.repeat(np.arange(lo, lo + n, dtype=np.int64), ranks),
                "compute_ms": compute.reshape(-1).round(3),
            }
        )
        if csv:
            with open(path, "ab") as f:
                pacsv.write_csv(table, f, pacsv.WriteOptions(include_header=lo == 0))
        else:
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
    if writer is not None:
        writer.close()


def child(command: list[str]) -> tuple[float, float]:
    """Run ``command`` under a wrapper process of its own; its wall time (s) and its peak resident
    memory (GB, the wrapper's children's, so each command is measured alone)."""
    wrapper = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
        "stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", wrapper, *command], check=True, capture_output=True, text=True
    )
    return time.monotonic() - started, int(out.stdout.split()[-1]) / 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--csv", action="store_true", help="a CSV table instead of Parquet")
    p.add_argument(
        "--root", default=None, help="where the table and the record go (default: a temporary dir)"
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        table = Path(tmp) / ("table.csv" if args.csv else "table.parquet")
        started = time.monotonic()
        write_table(table, args.steps, args.ranks, args.csv)
        rows = args.steps * args.ranks
        print(
            f"table: {rows:,} rows ({args.steps:,} steps x {args.ranks:,} ranks), "
            f"{table.stat().st_size / 1e9:.2f} GB, written in {time.monotonic() - started:.0f} s",
            flush=True,
        )
        out = Path(tmp) / "run"
        cli = [sys.executable, "-m", "pace_strategy.cli"]
        seconds, peak = child([*cli, "import", "table", str(table), str(out), "--format", "arrow"])
        size = sum(f.stat().st_size for f in out.iterdir()) / 1e9
        print(
            f"pace import table: {seconds:.0f} s, peak {peak:.1f} GB resident, record {size:.2f} GB",
            flush=True,
        )
        seconds, peak = child([*cli, "diagnose", str(out), "--no-report", "--project-ranks", ""])
        print(f"pace diagnose: {seconds:.0f} s, peak {peak:.1f} GB resident", flush=True)
        found = subprocess.run(
            [*cli, "diagnose", str(out), "--json", "--no-report", "--project-ranks", ""],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        top = json.loads(found.stdout)["findings"][0]
        print(f"  first finding: {top['mode']} ranks {top['ranks']} (injected: rank {args.ranks // 2})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
