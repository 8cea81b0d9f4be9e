"""``python -m pdjax.apps.cluster (worker|profile) JOB_JSON``: a worker process of the
cluster benchmark (its launcher starts these)."""

import sys

from pdjax.apps.cluster.worker import main

if __name__ == "__main__":
    sys.exit(main())
