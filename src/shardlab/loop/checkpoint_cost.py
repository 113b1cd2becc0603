"""What each checkpoint costs, on the record: when a save is due, how long training was held
up by it, how long the write took, how many bytes at what speed.

One line per save (rank 0), once the checkpoint is committed:
  shardlab: checkpoint step 8: 12.3 MiB, training held up 0.04 s, written in 0.31 s (0.04 GB/s)
and the same figures in metrics.json (`checkpoint_saves`, `checkpoint_blocking_s`,
`checkpoint_write_s`) with totals and their share of the wall clock in the run's summary.

[Note: held up versus written]
"Held up" is the time the training loop spent inside the save call on rank 0: for a
synchronous save the whole save (DCP's write, hashing, commit); for `checkpoint.async=true`
only the copy of the state (staging) and DCP's planning, the write and commit running in the
background. "Written" is from the call to the commit (the manifest's save_seconds, measured
by the checkpoint manager), so for an async save it includes the steps that trained meanwhile.
Bytes are the committed files' sizes as the manifest lists them; GB/s is bytes / written.
Rank 0's clock stands for all: the ranks leave a save together (its last act is a collective
agreement), so their held-up times differ by scheduling noise only.

`checkpoint.every_seconds` saves when that many seconds passed since the last save (or the
start), besides `every_steps`. Clocks differ per rank and every rank must save together, so
rank 0's clock decides and one tiny broadcast per step carries its answer (only when
every_seconds is set).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from shardlab.checkpoint.format import MANIFEST, step_dir_name


class CheckpointCost:
    """Decides when `every_seconds` makes a save due (`every_steps` is the manager's rule) and records what each save cost."""

    def __init__(self, root: str, rt: Any, every_seconds: float | None = None):
        self.root, self.rt, self.every_seconds = root, rt, every_seconds
        self.last_time = time.monotonic()
        self.saves: list[dict[str, Any]] = []        # committed saves, as metrics.json lists them
        self._held: dict[int, float] = {}           # step -> seconds held up, until its commit is seen

    def seconds_due(self) -> bool:
        """checkpoint.every_seconds passed since the last save (or the start), by rank 0's clock. Every
        rank calls it at the same step boundaries (a collective when every_seconds is set)."""
        if not self.every_seconds:
            return False
        flag = torch.tensor([float(time.monotonic() - self.last_time >= self.every_seconds)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(flag, 0)  # rank 0's clock decides (see the module's docstring)
        return bool(flag.item())

    def timed(self, step: int, save) -> Any:
        """Run `save()` (the manager's), recording how long it held training up."""
        t0 = time.perf_counter()
        out = save()
        self._held[step] = time.perf_counter() - t0
        self.last_time = time.monotonic()
        self.report()
        return out

    def report(self) -> None:
        """Rank 0: a line and a record for each save committed since the last call (an async one
        commits in the background: it shows at a later step boundary or at the end)."""
        for step in sorted(self._held):
            path = os.path.join(self.root, step_dir_name(step), MANIFEST)
            if not os.path.exists(path):
                continue
            held = self._held.pop(step)
            if not self.rt.is_main:
                continue
            with open(path) as f:
                manifest = json.load(f)
            size = sum(manifest.get("files", {}).values())
            write = float(manifest.get("save_seconds") or held)
            record = {"step": step, "bytes": size, "blocking_s": held, "write_s": write,
                      "gb_s": size / write / 1e9 if write > 0 else None}
            self.saves.append(record)
            print(line(record), flush=True)

    def summary(self, wall_s: float) -> dict[str, Any]:
        """metrics.json's checkpoint figures (rank 0's)."""
        blocking = [s["blocking_s"] for s in self.saves]
        write = [s["write_s"] for s in self.saves]
        return {"checkpoint_saves": self.saves, "checkpoint_blocking_s": blocking, "checkpoint_write_s": write,
                "checkpoint_blocking_total_s": sum(blocking), "checkpoint_write_total_s": sum(write),
                "checkpoint_blocking_fraction": sum(blocking) / wall_s if wall_s > 0 else None}


def line(r: dict[str, Any]) -> str:
    speed = f"{r['gb_s']:.2f} GB/s" if r["gb_s"] is not None else "-"
    return (f"shardlab: checkpoint step {r['step']}: {r['bytes'] / 2**20:.1f} MiB, training held up "
            f"{r['blocking_s']:.2f} s, written in {r['write_s']:.2f} s ({speed})")
