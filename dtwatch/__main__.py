import sys

from dtwatch.cli import main

sys.exit(main())
