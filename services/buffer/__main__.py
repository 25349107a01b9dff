import sys

from services.buffer.cli import main

sys.exit(main())
