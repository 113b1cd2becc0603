"""The training loop and what a run needs around it: one worker's runtime (runtime.py), the run
it builds (run.py), the loop (train.py: `train`, `train_step`, `worker_main`), its measurements
(measurements.py, run_summary.py, metrics.py), the loss and its precision (loss.py), optimizer
and schedule (schedule.py), validation (evaluate.py), preemption (preemption.py),
and the launchers that start workers (launcher.py, torchrun.py). The tools (plan, bench, verify,
export, deploy, the CLI) sit above it; nothing below it imports it.
"""
