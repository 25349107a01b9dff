"""`python -m services`: the `flywheel` command."""

import sys

from services.cli import main

sys.exit(main())
