"""`python -m shardlab.torchrun`: the command rendered Slurm and Kubernetes jobs start their agents
with (docs/preemption.md); it is loop/torchrun.py."""

import sys

from shardlab.loop.torchrun import main

if __name__ == "__main__":
    sys.exit(main())
