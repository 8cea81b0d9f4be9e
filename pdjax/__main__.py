"""``python -m pdjax``: the command line."""

import sys

from pdjax.cli import main

sys.exit(main())
