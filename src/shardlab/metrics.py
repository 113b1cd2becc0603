"""Measurement and run outputs: step timers, peak memory per rank, run_args.json, metrics.json.

Peak memory is measured, not modelled: on CUDA `torch.cuda.max_memory_allocated`; on CPU
the process's peak resident set size (getrusage), which includes the Python interpreter
and torch's libraries (~0.3-0.5 GB) on top of tensors. The per-engine comparison of model
state (parameters + gradients + optimizer state held by each rank) is reported separately
as exact tensor byte counts (`model_state_bytes`).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from typing import Any

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


def write_json_atomic(path: str, data: Any, *, default: Any = None) -> None:
    """Write to a temporary file in the same directory, flush it to disk, then rename: readers
    never see half a file, even after a crash. `default` as in json.dump (None: non-JSON
    values are an error, as a checkpoint manifest wants)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, default=default)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
