"""`python -m services.trainer -c run.toml` (also under torchrun)."""

import sys

from services.trainer.service_main import main

sys.exit(main())
