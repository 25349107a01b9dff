"""`python -m services.sandbox --socket PATH` (and `flywheel sandbox`): services/sandbox/cli.py."""

import sys

from services.sandbox.cli import main

sys.exit(main())
