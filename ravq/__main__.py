import sys

from ravq.cli.main import main

sys.exit(main())
