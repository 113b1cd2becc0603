"""The process-level runtime: where this worker sits in the job, its device, its process
group (with a timeout on every collective), and seeding.

Rank and world come from the environment the worker finds: torchrun / the elastic agent
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), Kubernetes pods started by
torchrun (the same), or a bare `srun` (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, with
MASTER_ADDR/MASTER_PORT exported by the batch script). No variables: one process.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import random
import socket
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardlab.loop import listen


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None        # None: no process group (one process)
    restart_count: int = 0     # how often the elastic agent restarted this group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def env_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's or Slurm's variables; (0, 0, 1) if none."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "MASTER_ADDR" in env:
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"])
    return 0, 0, 1


def in_launched_worker() -> bool:
    """True when some launcher (torchrun, srun, a pod spec) already set rank and world."""
    return env_world()[2] > 1 or "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def init_runtime(backend: str = "auto", timeout_s: float = 300.0, force_group: bool = False) -> Runtime:
    """Set up device and process group from the environment. A world of one gets no process
    group unless force_group (the distributed engines need one even at N=1)."""
    rank, local_rank, world = env_world()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        return_large_frees_to_os()
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise RuntimeError("parallel.backend=nccl needs CUDA GPUs; use gloo (or auto) on CPU")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if world == 1 and not force_group:
        return Runtime(rank, local_rank, world, device, None, restarts)
    if not dist.is_initialized():
        if world == 1 and "MASTER_ADDR" not in os.environ:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
            timeout = datetime.timedelta(seconds=timeout_s)
            store = _group_store(rank, world, timeout)
            # [Note: one key space per restart]
            # Under torchrun's elastic agent the workers share the agent's TCPStore, and
            # torch's env:// rendezvous hands them an unprefixed client of it. After a
            # restart the new group would then find the dead group's keys (e.g. gloo's
            # listening addresses) still there and dial them: "Connection refused", a
            # wasted restart. Prefixing by the restart count gives every attempt its own keys.
            # Only then: the count is each agent's own, and a membership change is no restart
            # to torch, so after an elastic grow the old agent's workers count 1 and the new
            # one's 0 and would never meet. An elastic agent shares no store ([Note: a joining
            # node and the agents' shared store] in loop/elastic.py): each group's rank 0 serves
            # a fresh one, with no old keys to avoid.
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                store = dist.PrefixStore(f"shardlab/restart_{restarts}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                    device_id=device if device.type == "cuda" else None)
    return Runtime(rank, local_rank, world, device, backend, restarts)


def _group_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The workers' store: the agent's (torchrun's default: env:// hands out a client of it), or one
    the group's rank 0 serves, bound to MASTER_ADDR's address only where env:// would bind every
    interface ([Note: who may reach a run's stores] in loop/listen.py)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return next(dist.rendezvous("env://", rank, world, timeout=timeout))[0]
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0 and listen.is_loopback(host) and not listen.is_loopback_name(host) and _spans_hosts(world):
        raise RuntimeError(f"MASTER_ADDR={host} resolves to a loopback address on this host, but the job spans "
                           "hosts: the other hosts could not reach the store; set MASTER_ADDR to an address "
                           "they reach (an IP address of this host)")
    return listen.worker_store(host, port, rank, world, timeout)


def _spans_hosts(world: int) -> bool:
    return int(os.environ.get("SLURM_NNODES", "1")) > 1 or world > int(os.environ.get("LOCAL_WORLD_SIZE", world))


# [Note: peak RSS on CPU and glibc's allocator]
# The sharded engines allocate and free unit-sized buffers (gathered parameters, unsharded
# gradients) many times per step. glibc serves allocations above its mmap threshold with
# mmap and returns them to the OS on free, but the threshold is dynamic: after the first such
# free it rises to the freed size, up to 32 MiB, and from then on such buffers come from the
# heap, where freed memory stays cached and fragments, so peak RSS runs above the live bytes.
# The worst of it came from gloo's own unit-sized temporaries inside all_gather_into_tensor
# and reduce_scatter_tensor, which the engines' collectives now avoid on CPU ([Note: flat
# collectives on CPU, without gloo's temporaries] in engines/collectives.py): fsdp on
# gpt2-small at N=4 went from 1.44 to 1.04 GiB of peak RSS (ddp: 1.97). What is left can
# still be traded for speed: a fixed threshold (mallopt M_MMAP_THRESHOLD) keeps large buffers
# mmapped, so each free gives its pages back at once, at the price of a page fault for every
# page of every large allocation, every time (a 16 MiB threshold made fsdp on gpt2-small at
# N=2 1.48x slower, measured before the collectives changed; docs/memory.md). So it is a
# choice, not a default: SHARDLAB_MMAP_THRESHOLD=<bytes> (e.g. 4194304) sets it in every
# worker, for runs where the host's memory, not speed, is what binds. (glibc's own
# MALLOC_MMAP_THRESHOLD_ works too, for every process.)
_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h


def return_large_frees_to_os() -> bool:
    """Fix glibc's mmap threshold when SHARDLAB_MMAP_THRESHOLD asks for it (see the Note
    above); True if it was set. A no-op where the C library has no mallopt."""
    threshold = int(os.environ.get("SHARDLAB_MMAP_THRESHOLD", "0"))
    if threshold <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False


def all_gather_object(obj: Any, rt: Runtime) -> list[Any]:
    """Every rank's `obj`, in rank order (just [obj] without a process group)."""
    if not rt.distributed or rt.world_size == 1:
        return [obj]
    out: list[Any] = [None] * rt.world_size
    dist.all_gather_object(out, obj)
    return out


# [Note: tearing down the process group]
# `destroy_process_group` only drops torch's own references to the group. The engines hold it
# too, inside reference cycles (module -> engine -> hooks -> module; PyTorch's DDP reducer and
# FSDP2's state likewise), together with the `Work` objects of their last collectives and the
# tensors those hold. Left to interpreter finalization, those cycles are destroyed while the
# interpreter is half gone: gloo's worker threads then release tensors that need the GIL, and
# the process dies with "terminate called without an active exception" (SIGABRT) after a
# finished run — seen with torch-ddp and torch-fsdp about one run in seven. So teardown
# (1) waits until every rank is done with the group (a barrier, on a clean exit only: after a
# failure a peer may never come), (2) collects the cycles while the interpreter is whole, so
# the engines and their pending work die now, and (3) destroys the group, whose last
# reference is then torch's own.

def shutdown(clean: bool = True) -> None:
    """Tear the process group down (see the Note above). `clean`: every rank got here
    normally, so they can meet at a barrier first."""
    if not dist.is_initialized():
        gc.collect()
        return
    if clean and dist.get_world_size() > 1:
        try:
            dist.barrier()
        except (RuntimeError, dist.DistBackendError):  # a peer died after all: tear down anyway
            pass
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def seed_everything(seed: int) -> None:
    """Same seed on every rank: model init is name-keyed (shardlab.models.init) and the data
    order comes from the sampler, so ranks differ only in which slice they read."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hostname() -> str:
    return socket.gethostname()
