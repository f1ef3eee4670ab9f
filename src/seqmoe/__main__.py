"""`python -m seqmoe` runs the `seqmoe` command."""

import sys

from seqmoe.cli import main

sys.exit(main())
