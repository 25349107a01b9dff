"""`python -m services.buffer -c run.toml` (and `flywheel buffer`)."""

import sys

from services.buffer.cli import main

sys.exit(main())
