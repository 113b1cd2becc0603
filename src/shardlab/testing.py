"""Run a function on N local processes with a gloo process group, for tests and benchmarks.

Process start-up dominates on small machines, so a test spawns once per world size and runs
many cases inside (`run_workers(n, fn)` where fn loops over its cases), as PyTorch's
`run_subtests` does. Every run has a timeout; a failing rank's traceback is raised in the
parent; a hung group is killed.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


class WorkerError(RuntimeError):
    pass


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, kwargs: dict,
            out_dir: str, timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # deferred: torch reads OMP_NUM_THREADS when it is imported, in this freshly spawned worker
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: Any
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            result = ("ok", fn(rank, world_size, *args, **kwargs))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_workers(world_size: int, fn: Callable, *args: Any, timeout_s: float = 240.0, **kwargs: Any) -> list[Any]:
    """Call fn(rank, world_size, *args, **kwargs) on world_size spawned processes that share a
    gloo process group; return the list of per-rank results (must be picklable)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="shardlab-workers-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, kwargs, tmp, timeout_s * 0.9),
                             daemon=False) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = timeout_s
        import time

        t0 = time.monotonic()
        for p in procs:
            p.join(max(0.1, deadline - (time.monotonic() - t0)))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(value)
            results.append(value)
        if hung:
            errors.insert(0, f"ranks {hung} still running after {timeout_s:.0f}s: killed")
        if errors:
            raise WorkerError("\n".join(errors))
        return results
