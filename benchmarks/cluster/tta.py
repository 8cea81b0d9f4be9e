"""Time to accuracy on the 2-worker cluster, as docs/results.md reports it.

    python benchmarks/cluster/tta.py          # as root: emulated links; else loopback

Trains each study of :data:`pdjax.apps.cluster_tta.STUDIES` (VGG on digits, the tiny GPT on
Python's docs) to its target with one worker, data parallelism on 2 workers and the
planner's 2-stage ``pipedream``, ``1f1b`` and ``2bw`` pipelines, at 100 Mbit/s, 1 Gbit/s
and 10 Gbit/s, seeds 0 and 1 (see pdjax/apps/cluster_tta.py). Every run's result is kept in
``benchmarks/results/cluster-tta/``: killed and rerun, it continues with the runs not
done yet. Writes ``benchmarks/results/cluster-tta/tta.{md,json}`` and one plot per study
and link. Run it on a quiet machine: about an hour on 2 cores.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from options import parse_no_options

from pdjax.apps.cluster_tta import report, run_tta

OUT = Path(__file__).resolve().parent.parent / "results" / "cluster-tta"


def main(argv: Sequence[str] | None = None) -> int:
    parse_no_options(__doc__, argv)
    t0 = time.monotonic()
    run_tta(OUT, log=lambda line: print(f"[{time.monotonic() - t0:5.0f} s] {line}", flush=True))
    for path in report(OUT, seconds=time.monotonic() - t0):
        print("wrote", path)
    print((OUT / "tta.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
