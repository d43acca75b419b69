"""`python -m graphstep ...`: the same as the `graphstep` command."""

import sys

from .cli import main

sys.exit(main())
