"""`python -m autotune ...` (the same as the `autotune` console script)."""

import sys

from autotune.cli import main

sys.exit(main())
