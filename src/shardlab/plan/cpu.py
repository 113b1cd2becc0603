"""`shardlab plan --gpu cpu`: this machine as plan's clock sees it (plan/clock.py), every figure measured
here: each matmul and attention shape of the probed step timed as it is, memory bandwidth, the cost of
dispatching one operator, and the loopback link (`INTERCONNECTS["loopback"]`, fitted by
`python -m shardlab.plan fit-loopback`). Each rank runs with the threads `shardlab train` gives it
(OMP_NUM_THREADS where set, else cores // ranks, at least 1: loop/launcher.py); more ranks than cores
share them.

Measured when plan runs (a second or two for a small model), on whatever else the cores are doing: each
figure is a mean over many calls, so a busy machine plans a slower step, as it would run one.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.nn.functional as F
from torch.utils import flop_counter

from shardlab.observe.flops import measured_peak
from shardlab.plan.catalogue import GPU
from shardlab.plan.clock import Machine

#: A measurement repeats its operation until this many seconds have passed (at least 3 calls): its mean.
MEASURE_S = 0.05
#: An operation of more FLOPs than this is not timed (a large model planned on this CPU): the ceiling prices it.
LARGEST_TIMED_FLOPS = 2e10
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def threads_per_rank(world: int) -> int:
    """The threads each worker gets: OMP_NUM_THREADS where set (the launcher keeps it), else its default."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return max(1, (os.cpu_count() or 1) // world)


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _mean_call(fn) -> float:
    """Seconds per call, the mean over MEASURE_S (at least 3 calls) after a first call that sets up its
    kernel: a mean, not the best call, so that the share of the cores a busy machine leaves is in it, as it
    is in the run's own steps."""
    fn()
    start, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - start < MEASURE_S:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def _bandwidth() -> float:
    """Bytes/s of an elementwise add over 4 MiB float32 tensors (two read, one written)."""
    a, b, out = torch.ones(2**20), torch.ones(2**20), torch.empty(2**20)
    return 3 * a.nbytes / _mean_call(lambda: torch.add(a, b, out=out))


def _host_op_seconds() -> float:
    """One tiny operator's dispatch: what each operator of a step costs beyond its data."""
    x = torch.ones(1)
    return _mean_call(lambda: [torch.add(x, x) for _ in range(100)]) / 100


class _Rates:
    """FLOP/s of each (op, dtype, shape) of a census, timed once here on real tensors."""

    def __init__(self, threads: int):
        self.threads, self.cache = threads, {}

    def __call__(self, kind: str, op: str, dtype: str, shape: tuple, flops: float) -> float | None:
        key = (op, dtype, shape)
        if key not in self.cache:
            self.cache[key] = self._measure(kind, op, _DTYPES.get(dtype), shape, flops)
        return self.cache[key]

    def _measure(self, kind, op, dtype, shape, flops) -> float | None:
        if dtype is None or not flops or flops > LARGEST_TIMED_FLOPS:
            return None
        t = [torch.randn(s, dtype=dtype) for s in shape]
        if kind == "matmul":
            call = {"mm": lambda: torch.mm(t[0], t[1]), "bmm": lambda: torch.bmm(t[0], t[1]),
                    "addmm": lambda: torch.addmm(t[0], t[1], t[2]),
                    "baddbmm": lambda: torch.baddbmm(t[0], t[1], t[2])}.get(op)
            if call is None or len(t) < (3 if op in ("addmm", "baddbmm") else 2):
                return None
            with _threads(self.threads):
                return flops / _mean_call(call)
        return self._attention(op, t, flops)

    def _attention(self, op: str, t: list[torch.Tensor], flops: float) -> float | None:
        """The forward's or the backward's rate at this shape (causal, as the models run it)."""
        if len(t) < 3:
            return None
        q, k, v = (x.requires_grad_() for x in t[:3])
        fwd = flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)
        with _threads(self.threads):
            with torch.no_grad():
                forward = _mean_call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            both = _mean_call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
        if op.endswith("backward"):
            return max(flops, 1) / max(both - forward, forward * 0.5)
        return fwd / forward


def cpu_machine(world: int) -> Machine:
    """This machine for one of `world` ranks (module docstring)."""
    threads = threads_per_rank(world)
    with _threads(threads):
        peak, peak_source = measured_peak(torch.device("cpu"), torch.float32)
        bandwidth, host = _bandwidth(), _host_op_seconds()
    cores = os.cpu_count() or 1
    sources = {"matmul": f"each shape timed here at {threads} thread(s); others at the measured peak "
                         f"{peak / 1e9:.1f} GFLOP/s ({peak_source})",
               "attention": "each shape timed here (causal SDPA, forward and backward)",
               "memory": f"measured here: {bandwidth / 1e9:.1f} GB/s (4 MiB float32 add)",
               "optimizer": f"measured here: {bandwidth / 1e9:.1f} GB/s (4 MiB float32 add)",
               "host": f"measured here: {host * 1e6:.1f} us per operator"}
    return Machine("cpu", {"fp32": peak}, bandwidth, host, 1.0, False, sources, set(), _Rates(threads),
                   slowdown=max(1.0, world / cores))


def cpu_gpu() -> GPU:
    """This machine as a catalogue entry for the memory verdict: its RAM, and its measured fp32 peak."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    peak, source = measured_peak(torch.device("cpu"), torch.float32)
    return GPU("cpu", ram, True, {"fp32": peak}, 0.0, f"this machine: {source}", intra_node="loopback",
               inter_node="loopback")
