"""Time to accuracy on the cluster: :mod:`pdjax.apps.cluster.tta` (the studies, the runs and
what their workers run) and :mod:`pdjax.apps.cluster.tta_report` (their report), under the
module path that the runs' configs name (``pdjax.apps.cluster_tta:cluster_spec``) and that
starts their workers (``python -m pdjax.apps.cluster_tta worker JOB_JSON``). Its public
names are those of ``pdjax.apps.cluster.tta.__all__`` and :func:`report`.

Run it with ``pdjax bench --cluster --tta`` or ``python benchmarks/cluster/tta.py``.
"""

from __future__ import annotations

import sys

from pdjax.apps.cluster.tta import ALONE as ALONE
from pdjax.apps.cluster.tta import LINKS as LINKS
from pdjax.apps.cluster.tta import PIPELINES as PIPELINES
from pdjax.apps.cluster.tta import RUN_TIMEOUT as RUN_TIMEOUT
from pdjax.apps.cluster.tta import RUNNERS as RUNNERS
from pdjax.apps.cluster.tta import STUDIES as STUDIES
from pdjax.apps.cluster.tta import M as M
from pdjax.apps.cluster.tta import TTAStudy as TTAStudy
from pdjax.apps.cluster.tta import cluster_spec as cluster_spec
from pdjax.apps.cluster.tta import link_key as link_key
from pdjax.apps.cluster.tta import load_results as load_results
from pdjax.apps.cluster.tta import main as main
from pdjax.apps.cluster.tta import run_tta as run_tta
from pdjax.apps.cluster.tta import two_stages as two_stages
from pdjax.apps.cluster.tta_report import markdown as markdown
from pdjax.apps.cluster.tta_report import plot as plot
from pdjax.apps.cluster.tta_report import report as report
from pdjax.apps.cluster.tta_report import summarize as summarize

if __name__ == "__main__":
    sys.exit(main())
