"""``python -m loadtest SCENARIO [options]``: see ``loadtest.cli``."""

import sys

from loadtest.cli import main

sys.exit(main())
