"""`python -m services.tinker --model DIR` (and `flywheel tinker`): services/tinker/cli.py."""

import sys

from services.tinker.cli import main

sys.exit(main())
