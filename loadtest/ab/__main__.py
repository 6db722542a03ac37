"""``python -m loadtest.ab``: see ``loadtest.ab.cli``."""

import sys

from loadtest.ab.cli import main

sys.exit(main())
