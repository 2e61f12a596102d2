import sys

from ravq.cli import main

sys.exit(main())
