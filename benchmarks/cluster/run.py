"""The cluster-on-one-machine benchmark, as docs/results.md reports it.

    python benchmarks/cluster/run.py          # as root: emulated links; else loopback

Writes benchmarks/results/cluster.{json,md,png}; see pdjax/apps/cluster.py for what is measured
and what is predicted. About 15 minutes on 2 cores (run it on a quiet machine).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from options import parse_no_options

from pdjax.apps.cluster import format_markdown, run_cluster, write_results

RESULTS = Path(__file__).resolve().parent.parent / "results"


def main(argv: Sequence[str] | None = None) -> int:
    parse_no_options(__doc__, argv)
    t0 = time.monotonic()
    result = run_cluster(
        fast_mbit=10000.0,
        repeats=3,
        log=lambda line: print(f"[{time.monotonic() - t0:5.0f} s] {line}", flush=True),
    )
    print(format_markdown(result))
    for path in write_results(result, RESULTS):
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
