"""Time to accuracy on the 2-worker cluster, as docs/results.md reports it.

    python benchmarks/cluster/tta.py          # as root: emulated links; else loopback
    python benchmarks/cluster/tta.py --studies vgg-digits --seeds 1 --out out/cluster-tta

Trains each study of :data:`benchmarks.harness.cluster_tta.STUDIES` (VGG on digits, the tiny
GPT on Python's docs) to its target with one worker, data parallelism on 2 workers and the
planner's 2-stage ``pipedream``, ``1f1b`` and ``2bw`` pipelines, at 100 Mbit/s, 1 Gbit/s
and 10 Gbit/s, seeds 0 and 1 (see benchmarks/harness/cluster/tta.py). Every run's result is
kept in --out (``benchmarks/results/cluster-tta/`` by default): killed and rerun, it
continues with the runs not done yet. Writes ``tta.{md,json}`` there and one plot per study
and link. Run it on a quiet machine: about an hour on 2 cores with the defaults.
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

from benchmarks.cluster.options import parse_tta  # noqa: E402
from benchmarks.harness.cluster_tta import LINKS, STUDIES, report, run_tta  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_tta(__doc__, argv)
    unknown = [s for s in args.studies if s not in STUDIES]
    if unknown:
        print(
            f"{Path(sys.argv[0]).name}: error: --studies: unknown {unknown}; choose from "
            f"{list(STUDIES)}",
            file=sys.stderr,
        )
        return 2
    t0 = time.monotonic()
    run_tta(
        args.out,
        studies=args.studies or list(STUDIES),
        rates_mbit=args.rates or LINKS,
        seeds=range(args.seed, args.seed + args.seeds),
        emulate=False if args.loopback else None,
        log=lambda line: print(
            f"[{time.monotonic() - t0:5.0f} s] {line}", file=sys.stderr, flush=True
        ),
    )
    md, js, *plots = report(args.out, seconds=time.monotonic() - t0)
    print(js.read_text() if args.json else md.read_text())
    for path in (md, js, *plots):
        print("wrote", path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
