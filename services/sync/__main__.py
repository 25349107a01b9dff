import sys

from services.sync.cli import main

sys.exit(main())
