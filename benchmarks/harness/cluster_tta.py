"""Time to accuracy on the cluster: :mod:`benchmarks.harness.cluster.tta` (the studies, the runs and
what their workers run) and :mod:`benchmarks.harness.cluster.tta_report` (their report), under the
module path that the runs' configs name (``benchmarks.harness.cluster_tta:cluster_spec``) and that
starts their workers (``python -m benchmarks.harness.cluster_tta worker JOB_JSON``). Its public
names are those of ``benchmarks.harness.cluster.tta.__all__`` and :func:`report`.

Run it with ``python benchmarks/cluster/tta.py`` (``--help`` for its options).
"""

from __future__ import annotations

import sys

from benchmarks.harness.cluster.tta import ALONE as ALONE
from benchmarks.harness.cluster.tta import LINKS as LINKS
from benchmarks.harness.cluster.tta import PIPELINES as PIPELINES
from benchmarks.harness.cluster.tta import RUN_TIMEOUT as RUN_TIMEOUT
from benchmarks.harness.cluster.tta import RUNNERS as RUNNERS
from benchmarks.harness.cluster.tta import STUDIES as STUDIES
from benchmarks.harness.cluster.tta import M as M
from benchmarks.harness.cluster.tta import TTAStudy as TTAStudy
from benchmarks.harness.cluster.tta import cluster_spec as cluster_spec
from benchmarks.harness.cluster.tta import link_key as link_key
from benchmarks.harness.cluster.tta import load_results as load_results
from benchmarks.harness.cluster.tta import main as main
from benchmarks.harness.cluster.tta import run_tta as run_tta
from benchmarks.harness.cluster.tta import two_stages as two_stages
from benchmarks.harness.cluster.tta_report import markdown as markdown
from benchmarks.harness.cluster.tta_report import plot as plot
from benchmarks.harness.cluster.tta_report import report as report
from benchmarks.harness.cluster.tta_report import summarize as summarize

if __name__ == "__main__":
    sys.exit(main())
