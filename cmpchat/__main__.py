import sys

from cmpchat.cli import main

sys.exit(main())
