"""`python -m services.engine --model DIR` (and `flywheel engine`): services/engine/cli.py."""

import sys

from services.engine.cli import main

sys.exit(main())
