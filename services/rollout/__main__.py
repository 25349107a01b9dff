import sys

from services.rollout.cli import main

sys.exit(main())
