"""python -m shardlab.plan fit-loopback: fit the loopback link's constants (plan/fit.py)."""

import sys

from shardlab.plan.fit import main

sys.exit(main())
