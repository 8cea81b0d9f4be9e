"""Time to accuracy: statistical and hardware efficiency of the schedules.

Part 1, measured (4 in-process CPU devices): the CNN on digits and the GPT (tiny) on text
(characters of Python's docs), trained with data parallelism and with ``pipedream``,
``pipedream`` without weight stashing, ``pipedream`` with vertical sync, ``2bw`` and
``1f1b`` on a fixed plan (``even``: equal layer counts, one device per stage, 4 stages), so
that the comparison is about schedules, not partitions. For each run: epochs to the target
accuracy (statistical efficiency), seconds per epoch (hardware efficiency) and training
seconds to the target; plots of test accuracy against epochs and against seconds.

Part 2, simulated at scale: PipeDream's published profiles (VGG-16, AlexNet, ResNet-50,
GNMT, measured on V100s) on the SOSP'19 paper's clusters (4 servers x 4 V100, 10 Gbit/s;
2 servers x 8 V100, 25 Gbit/s): the planner's plan for each schedule (``pipedream`` with
round-robin replication available, and split only), PipeDream's own 15-1 evaluated by hand,
the simulator's time per microbatch, the predicted speedup over data parallelism on the
same devices, and what the paper reports.

Run from the repository root (about 7 minutes on 2 idle cores; part 2 alone, a few
seconds)::

    python benchmarks/tta.py                  # everything, 2 seeds
    python benchmarks/tta.py --simulated-only # part 2 only (= --parts simulated)
    python benchmarks/tta.py --parts digits --seeds 0 --text-seeds 0

Writes ``benchmarks/results/tta.md``, ``tta-simulated.md`` and the PNGs next to them, and
prints the tables.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 4)

from pdjax.apps.plots import plot_training  # noqa: E402

# Run as a script, Python puts this folder on sys.path; loaded by its file path (as the
# tests load it), nothing does, and the benchmark's own modules must be found either way.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)

from ttabench.measured import (  # noqa: E402
    STUDIES,
    VARIANTS,
    Study,
    run_study,
    study_table,
    write_measured,
)
from ttabench.paper import (  # noqa: E402
    GNMT8_12_GPUS,
    PAPER,
    PAPER_PLANS,
    TABLE1,
    PaperResult,
    Table1Row,
)
from ttabench.report import WHY, differences, headline, simulated_table, write_simulated  # noqa: E402
from ttabench.simulated import (  # noqa: E402
    HEADLINE,
    SIM_CLUSTERS,
    SIM_MODELS,
    SIM_VARIANTS,
    V100_BYTES,
    SimRow,
    SimVariant,
    data_parallel_seconds,
    flat_planning,
    simulated_rows,
)
from ttabench.table1 import (  # noqa: E402
    CLUSTER_TTA,
    StatEfficiency,
    Table1Result,
    load_cluster_tta,
    statistical_efficiency,
    table1_results,
    table1_section,
)

# The names the script held before it was split into ttabench/: the tests load the script
# by its path and reach its parts through it.
__all__ = [
    "CLUSTER_TTA",
    "GNMT8_12_GPUS",
    "HEADLINE",
    "PAPER",
    "PAPER_PLANS",
    "RESULTS",
    "SIM_CLUSTERS",
    "SIM_MODELS",
    "SIM_VARIANTS",
    "STUDIES",
    "TABLE1",
    "V100_BYTES",
    "VARIANTS",
    "WHY",
    "PaperResult",
    "SimRow",
    "SimVariant",
    "StatEfficiency",
    "Study",
    "Table1Result",
    "Table1Row",
    "data_parallel_seconds",
    "differences",
    "flat_planning",
    "headline",
    "load_cluster_tta",
    "main",
    "run_study",
    "simulated_rows",
    "simulated_table",
    "statistical_efficiency",
    "study_table",
    "table1_results",
    "table1_section",
    "write_measured",
    "write_simulated",
]

RESULTS = Path(__file__).parent / "results"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1", help="seeds of the digits study")
    parser.add_argument(
        "--text-seeds", default="0,1", help="seeds of the text study (about 3 min each)"
    )
    parser.add_argument(
        "--parts", default="digits,text,simulated", help="any of digits, text, simulated"
    )
    parser.add_argument("--out", default=str(RESULTS), help="folder for the md and PNG files")
    parser.add_argument(
        "--simulated-only",
        action="store_true",
        help="regenerate only tta-simulated.md (the same as --parts simulated; no training)",
    )
    return parser.parse_args(argv)


def run_measured(
    studies: Sequence[Study],
    seeds: dict[str, list[int]],
    out: Path,
    command: str,
    log: Callable[[str], None],
) -> None:
    """Part 1: trains every study, plots its first seed's runs, writes ``tta.md``."""
    t0 = time.perf_counter()
    results = {}
    for study in studies:
        results[study.name] = run_study(study, seeds[study.name], log)
        first = [r for r in results[study.name] if r.config.seed == seeds[study.name][0]]
        plot_training(first, out, prefix=f"tta-{study.name}-")
    text = write_measured(studies, results, seeds, command, time.perf_counter() - t0)
    (out / "tta.md").write_text(text)
    print(text)


def run_simulated(out: Path, command: str, log: Callable[[str], None]) -> None:
    """Part 2: plans and simulates every schedule, writes ``tta-simulated.md``."""
    t0 = time.perf_counter()
    rows, dp = simulated_rows(log)
    table1 = table1_section(table1_results(rows, log), load_cluster_tta())
    text = write_simulated(rows, dp, command, flat_planning(*HEADLINE), table1)
    log(f"  part 2: {time.perf_counter() - t0:.0f} s")
    (out / "tta-simulated.md").write_text(text)
    print(text)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    seeds = {
        "digits": [int(s) for s in args.seeds.split(",") if s.strip()],
        "text": [int(s) for s in args.text_seeds.split(",") if s.strip()],
    }
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if args.simulated_only:
        parts = ["simulated"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/tta.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    command = command.strip()

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    studies = [STUDIES[p] for p in parts if p in STUDIES]
    if studies:
        run_measured(studies, seeds, out, command, log)
    if "simulated" in parts:
        run_simulated(out, command, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
