"""The cluster-on-one-machine benchmark, as docs/results.md reports it.

    python benchmarks/cluster/run.py          # as root: emulated links; else loopback
    python benchmarks/cluster/run.py --rates 1000,10000 --loopback --out out/cluster

Writes cluster.{json,md,png} and cluster-ranking.png into --out (benchmarks/results by
default); see benchmarks/harness/cluster/ for what is measured and what is predicted. About
25 minutes on 2 cores with the defaults (run it on a quiet machine).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

# run as a file, Python puts benchmarks/cluster/ on sys.path: the repository's root holds
# the benchmarks package
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.cluster.options import parse_cluster  # noqa: E402
from benchmarks.harness.cluster import (  # noqa: E402
    MICROBATCH,
    format_markdown,
    run_cluster,
    write_results,
)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_cluster(__doc__, argv)
    t0 = time.monotonic()
    result = run_cluster(
        rates_mbit={m: args.rates for m in MICROBATCH} if args.rates else None,
        fast_mbit=args.fast_rate,
        repeats=args.repeats,
        seed=args.seed,
        emulate=False if args.loopback else None,
        log=lambda line: print(
            f"[{time.monotonic() - t0:5.0f} s] {line}", file=sys.stderr, flush=True
        ),
    )
    paths = write_results(result, args.out)
    print(result.to_json() if args.json else format_markdown(result))
    for path in paths:
        print("wrote", path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
