import sys

from einjoin.cli import main

sys.exit(main())
