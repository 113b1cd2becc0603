"""Observation: where a run's time and memory go, read from what runs already write.

- flops.py: FLOPs as torch's formulas count them (`CountFlops`: plan's probes and the loop's
  first step use the same class) and the device's peak (`device_peak`: plan's catalogue for a
  known GPU, else this machine's measured matmul peak, cached).
- trackers.py: the experiment trackers of `output.trackers` (TensorBoard, wandb, MLflow), fed
  with the per-step record (`steps.jsonl`) and MFU by the loop's measurements
  (loop/measurements.py: `StepLogger`, `StepFlops`).
- runs.py: a run directory read back (metrics.json, steps.jsonl, the flight records of every
  attempt): attempts, per rank and step the time split into data wait, compute, exposed
  communication and checkpoint, the slowest rank.
- report.py (`shardlab report`: one self-contained HTML file, plots.py draws it) and trace.py
  (`shardlab trace`: the flight records as one Chrome trace-event JSON).
The readers never reach into a live engine: they read files under the run directory, so they
work on a finished run, a failed one, one still running, and a copy of a cluster's run dir.
"""
