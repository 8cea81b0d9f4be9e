"""``python -m pdjax``: the command line."""

import sys

from pdjax.apps.cli import main

sys.exit(main())
