"""Step timers and peak memory per rank (what run_args.json holds: run.py's `run_args`).

Peak memory is measured, not modelled: on CUDA `torch.cuda.max_memory_allocated`; on CPU
the process's peak resident set size (getrusage), which includes the Python interpreter
and torch's libraries (~0.3-0.5 GB) on top of tensors. The per-engine comparison of model
state (parameters + gradients + optimizer state held by each rank) is reported separately
as exact tensor byte counts (`model_state_bytes`).
"""

from __future__ import annotations

import resource
import statistics
import sys

import torch


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class StepTimer:
    """Wall time per optimizer step; the first `warmup` steps are kept but excluded from the median."""

    def __init__(self, warmup: int = 1):
        self.warmup = warmup
        self.times: list[float] = []

    def add(self, seconds: float) -> None:
        self.times.append(seconds)

    def median(self) -> float:
        measured = self.times[self.warmup:] or self.times
        return statistics.median(measured) if measured else float("nan")
