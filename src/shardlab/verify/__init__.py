"""`shardlab verify CONFIG --nproc N`: prove that the user's own config trains exactly as one
process would, gradient by gradient (docs/verify.md).

  runs.py       the runs (reference, noise, engine) through run.build_run / train.train_step,
                and what each records; the worker
  compare.py    the error of every quantity, the first difference
  tolerance.py  the tolerance, from the compute dtype and the model's size
  causes.py     the likely cause of the first difference
  report.py     the table and verdict as text
  command.py    the command: checks before spawning, the plan, the launch, exit codes
"""

from shardlab.verify.command import add_arguments, run

__all__ = ["add_arguments", "run"]
