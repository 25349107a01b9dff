"""`python -m services.trainer -c run.toml` (also under torchrun)."""

import sys

from services.trainer.cli import main

sys.exit(main())
