"""`python -m shardlab ...` is the `shardlab` command (torchrun runs workers as `-m shardlab train`)."""

import sys

from shardlab.cli import main

sys.exit(main())
