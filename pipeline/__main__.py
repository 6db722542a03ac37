"""``python -m pipeline JOB``: see pipeline/cli.py."""

import sys

from pipeline.cli import main

sys.exit(main())
