"""`python -m treadle.cli`: the same as the `treadle` command."""

import sys

from treadle.cli import main

sys.exit(main())
