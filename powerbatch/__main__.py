import sys

from powerbatch.cli.main import main

sys.exit(main())
