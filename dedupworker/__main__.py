import sys

from dedupworker.ops.cli.main import main

sys.exit(main())
