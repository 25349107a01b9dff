"""`python -m services.sync -c run.toml` (and `flywheel sync`)."""

import sys

from services.sync.cli import main

sys.exit(main())
