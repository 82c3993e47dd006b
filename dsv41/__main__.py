import sys

from dsv41.cli import main

sys.exit(main())
