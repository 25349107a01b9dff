"""`python -m services.rollout -c run.toml` (and `flywheel rollout`)."""

import sys

from services.rollout.cli import main

sys.exit(main())
