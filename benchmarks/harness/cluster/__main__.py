"""``python -m benchmarks.harness.cluster (worker|profile) JOB_JSON``: a worker process of the
cluster benchmark (its launcher starts these)."""

import sys

from benchmarks.harness.cluster.worker import main

if __name__ == "__main__":
    sys.exit(main())
