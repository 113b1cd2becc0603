"""Measurement and run outputs: step timers, peak memory per rank, what run_args.json holds.

Peak memory is measured, not modelled: on CUDA `torch.cuda.max_memory_allocated`; on CPU
the process's peak resident set size (getrusage), which includes the Python interpreter
and torch's libraries (~0.3-0.5 GB) on top of tensors. The per-engine comparison of model
state (parameters + gradients + optimizer state held by each rank) is reported separately
as exact tensor byte counts (`model_state_bytes`).
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import subprocess
import sys

import torch

import shardlab


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def git_commit(path: str | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path or os.getcwd(), capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def run_args(cfg_dict: dict, world_size: int, hostnames: list[str], extra: dict | None = None) -> dict:
    return {
        "config": cfg_dict,
        "world_size": world_size,
        "hostnames": hostnames,
        "shardlab_version": shardlab.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git_commit(os.path.dirname(os.path.abspath(__file__))),
        "argv": sys.argv,
        **(extra or {}),
    }


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
