import sys

from dedupworker.cli import main

sys.exit(main())
