"""Run a function on N local processes with a gloo process group, for tests and benchmarks.

Process start-up dominates on small machines, so a test spawns once per world size and runs
many cases inside (`run_workers(n, fn)` where fn loops over its cases), as PyTorch's
`run_subtests` does. Every run has a timeout; a failing rank's traceback is raised in the
parent; a hung group is killed.

[Note: workers from a forkserver] A spawned worker paid about 2-3 CPU-s to import torch and
shardlab before its first collective, and the test suite starts hundreds of them: on a 2-core
machine that was a tenth of the suite. The workers are forked from multiprocessing's forkserver
instead, a clean single-threaded process that imported torch and shardlab's training modules
once (`WORKER_PRELOAD`) and forks a fresh child per rank, so each child starts with them
imported. A fork of that server is as isolated as a spawn for what the workers do: no process
group, thread pool or CUDA context exists in the server (importing torch creates none), Python's
`random` reseeds itself in a forked child, and the parent's current environment is applied in the
child (`_worker`), since the server kept the one it started with. What a fork cannot redo is
what torch read from the environment while it was imported; workers set their thread count
explicitly. Where fork is unsafe or unavailable (not Linux), or plugins are named, `run_workers`
spawns as before.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


class WorkerError(RuntimeError):
    pass


# What the forkserver imports once for every worker it forks (a name missing here is skipped)
WORKER_PRELOAD = ("torch", "torch.distributed", "shardlab.testing", "shardlab.engines", "shardlab.loop.train")


def _worker_context() -> mp.context.BaseContext:
    """The forkserver with the workers' imports done, where there is one (Linux); spawn elsewhere,
    and where SHARDLAB_PLUGINS is set: a plugin registers before shardlab.config is first imported
    (shardlab/__init__.py), which a server that preloaded shardlab without it cannot redo."""
    if not sys.platform.startswith("linux") or os.environ.get("SHARDLAB_PLUGINS"):
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(WORKER_PRELOAD))
    # the server imports torch, which reads OMP_NUM_THREADS then: one thread, as every worker
    # sets, without leaving the variable set in this process
    unset = "OMP_NUM_THREADS" not in os.environ
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        forkserver.ensure_running()
    finally:
        if unset:
            del os.environ["OMP_NUM_THREADS"]
    return ctx


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, kwargs: dict,
            out_dir: str, timeout_s: float, environ: dict[str, str] | None = None) -> None:
    if environ is not None:  # forked from the forkserver: the parent's environment as it is now
        os.environ.clear()
        os.environ.update(environ)
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
    ctx = _worker_context()
    environ = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
    with tempfile.TemporaryDirectory(prefix="shardlab-workers-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=False,
                             args=(r, world_size, store_path, fn, args, kwargs, tmp, timeout_s * 0.9, environ))
                 for r in range(world_size)]
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
