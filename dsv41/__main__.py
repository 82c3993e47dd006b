import sys

from dsv41.app.cli import main

sys.exit(main())
