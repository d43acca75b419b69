"""`python -m graphstep ...`: the same as the `graphstep` command."""

import sys

from graphstep.cli import main

sys.exit(main())
