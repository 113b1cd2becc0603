"""`shardlab plan --gpu cpu`: this machine as plan's clock sees it (plan/clock.py), every figure measured
here: each matmul and attention shape of the probed step timed as it is, memory bandwidth, the cost of
dispatching one operator, and the loopback link (`INTERCONNECTS["loopback"]`, fitted by
`python -m shardlab.plan fit-loopback`). Each rank runs with the threads `shardlab train` gives it
(OMP_NUM_THREADS where set, else cores // ranks, at least 1: loop/launcher.py); more ranks than cores
share them.

Measured when plan runs (a second or two for a small model): each figure is a mean over many calls, in
the thread's CPU time where a rank runs one thread, so that plan predicts the step of an idle machine
however busy it is when plan runs (a busy machine's run is slower by its share of the cores).
"""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils import flop_counter

from shardlab.observe.flops import measured_peak
from shardlab.plan.catalogue import GPU
from shardlab.plan.clock import Machine, NarrowStep, operation_seconds
from shardlab.plan.ops import Census

#: A measurement repeats its operation until this many seconds have passed (at least 3 calls): its mean.
MEASURE_S = 0.05
#: An operation of more FLOPs than this is not timed (a large model planned on this CPU): the ceiling prices it.
LARGEST_TIMED_FLOPS = 2e10
#: A memory-bound kernel is replayed for this long (there are many), and not beyond this many bytes.
KERNEL_MEASURE_S = 0.01
LARGEST_TIMED_BYTES = 2e9
#: A timed operation cycles through copies of its operands at least this large together, so that each call
#: finds them beyond the core's own cache, as a step does (each operand was last touched several operations
#: before). Operands hot in L2 ran gpt-tiny's matmul shapes 7-26 % faster than cycled ones (this VM's EPYC,
#: 2 MiB of L2 per core, 2026-11-28), and the 1-rank steps came out 10-14 % above the clock.
COLD_BYTES = 16 * 2**20
# A memory-bound kernel also writes its output where a step's lands: memory last touched several operations
# before, not the block the allocator hands straight back when the previous call's output is dropped. So
# its replay keeps as many outputs alive as it cycles copies of its operands. GELU at (4, 128, 512), one
# thread: 149-162 us with its output block reused, 180-229 us with the outputs kept, 220 us a call inside
# gpt-tiny's step (the thread's CPU time per operator, 2026-11-28). The matmuls keep the reused block: inside
# the step gpt-tiny's mm and addmm took 74.8 and 37.2 ms against 76.4 and 38.7 priced so, and kept outputs
# raised a (512, 128) x (128, 512) product by 16-20 %.
#: and through no more copies than this (a tiny kernel's would be many thousands)
MOST_COPIES = 64
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


def _clock():
    """The calling thread's CPU time where it computes alone (one thread: other processes on the cores do
    not stretch it, so plan predicts the step an idle machine runs: [Note: the host's work, measured]),
    else wall time (intra-op threads: their CPU time adds up beyond the wall's)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _mean_call(fn, measure_s: float = MEASURE_S) -> float:
    """Seconds per call, the mean over `measure_s` (at least 3 calls) after a first call that sets up its
    kernel (`_clock`'s seconds)."""
    fn()
    clock = _clock()
    start, calls = clock(), 0
    while calls < 3 or clock() - start < measure_s:
        fn()
        calls += 1
    return (clock() - start) / calls


def _bandwidth() -> float:
    """Bytes/s of an elementwise add over 4 MiB float32 tensors (two read, one written)."""
    a, b, out = torch.ones(2**20), torch.ones(2**20), torch.empty(2**20)
    return 3 * a.nbytes / _mean_call(lambda: torch.add(a, b, out=out))


def _host_op_seconds() -> float:
    """One tiny operator's dispatch: what each operator of a step costs beyond its data."""
    x = torch.ones(1)
    return _mean_call(lambda: [torch.add(x, x) for _ in range(100)]) / 100


def _build(spec):
    """A value of `arg_spec` made real: a tensor of its shape and dtype, the rest as it is. Floats are
    drawn from [0.5, 1.5): in every elementwise function's domain, as a step's values are where it
    matters (Adam's sqrt reads a second moment, never negative). Normal draws sent half of a sqrt's
    inputs down its NaN path, 18 times slower on this VM's EPYC (131,072 floats: 1,042 us against 58,
    2026-11-28): gpt-tiny's AdamW step was priced at 9.3 ms a rank at 4 ranks, 3.0 with these draws."""
    if isinstance(spec, tuple) and len(spec) == 3 and spec[0] == "T":
        dtype = _DTYPES.get(spec[2]) or getattr(torch, spec[2])
        if dtype.is_floating_point:
            return torch.rand(spec[1], dtype=dtype) + 0.5
        return torch.zeros(spec[1], dtype=dtype)
    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "D":
        return _DTYPES.get(spec[1]) or getattr(torch, spec[1])
    if isinstance(spec, tuple):
        return [_build(v) for v in spec]
    return spec


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
        if kind in ("memory", "optimizer"):
            return self._kernel(op, shape, flops)
        if dtype is None or not flops or flops > LARGEST_TIMED_FLOPS:
            return None
        t = [torch.randn(s, dtype=dtype) for s in shape]
        if kind == "matmul":
            func = {"mm": torch.mm, "bmm": torch.bmm, "addmm": torch.addmm, "baddbmm": torch.baddbmm}.get(op)
            if func is None or len(t) < (3 if op in ("addmm", "baddbmm") else 2):
                return None
            operands = itertools.cycle(_copies(t, lambda: [torch.randn(s, dtype=dtype) for s in shape]))
            with _threads(self.threads):
                return flops / _mean_call(lambda: func(*next(operands)))
        return self._attention(op, t, flops)

    def _kernel(self, op: str, spec: tuple, moved: float) -> float | None:
        """Bytes/s of a memory-bound kernel replayed at its arguments (plan/ops.py, `arg_spec`): random
        floats, zeros for integer tensors (valid indices). None where it cannot be replayed."""
        if moved > LARGEST_TIMED_BYTES:
            return None
        try:
            namespace, name, overload = op.split(".")
            func = getattr(getattr(getattr(torch.ops, namespace), name), overload)
            def build():
                return _build(spec[0]), {k: _build(v) for k, v in spec[1]}

            copies = _copies(build(), build, moved)
            calls, outputs = itertools.cycle(copies), collections.deque(maxlen=len(copies))
            with _threads(self.threads):
                return moved / _mean_call(lambda: outputs.append((lambda a, kw: func(*a, **kw))(*next(calls))),
                                          KERNEL_MEASURE_S)
        except Exception:  # an argument the spec cannot rebuild (a value the kernel checks): its bytes price it
            return None

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


# [Note: the host's work, measured]
# On a CPU the host is the device, so everything the host does in a step adds to it: each operator's
# dispatch, and the Python between operators (the modules' calls, the engine's hooks and per-parameter
# bookkeeping, each collective's launch, the optimizer's per-tensor loop, autograd building and walking
# its graph). One operator's dispatch times the number of operators misses most of the second: the
# sharded engines do 1.4-2.7 times ddp's host work on gpt-tiny (measured so, 2026-11-28) with about as
# many operators. So `--gpu cpu` measures it on the engine's own step: the config as it is (depth,
# heads, vocabulary, micro batches, checkpointing, the engine and its options, a fake group of the real
# world size, as plan's probes run it) at a width of `_HOST_HEAD_DIM` per head and `_HOST_SEQ` tokens, where the
# arithmetic is negligible and every call the step makes remains, each costing what it costs here. The
# median step in the thread's CPU time is the host's work; the matmuls, attention and memory-bound
# kernels of the real width are priced on top of it as before. Only GPT models can be narrowed by a key
# (`model.n_embd`); others fall back to one operator's dispatch per operator.
#
# Beyond one rank the narrow step keeps the real width, so that its collectives carry the real bytes, and
# narrows only the tokens (`_HOST_SEQ` a sample): it runs on a real gloo group of the world's size, one
# local process per rank (`_real_group_step`), trained by the loop's own `train` as `shardlab train` trains
# it (the hang doctor's records of each collective, the step's measurements). Its median wall time holds
# the host's work, every collective whole as it runs inside a step (the call's latency, the hand-off to
# gloo's thread, the bytes copied through loopback, waiting for the other ranks, more ranks than cores
# taking turns) and the arithmetic of its few tokens, which plan prices from the same step's census taken
# on one process (`_HostSteps._one_rank`) and subtracts; the real width's arithmetic is priced on top, and
# the link prices nothing (`NarrowStep.collectives`). Collectives timed alone missed their cost inside a
# step both ways: a fit at 2 workers stretched by ranks / cores priced gpt-mini's fsdp bytes at 4 ranks on 2
# cores at 337 ms a step against about 140 inside it (its plan 1.11-1.16 of the measured step), while inside
# a 2-rank step torch-fsdp's and zero3's collectives cost 46-70 ms more than the fit said (2026-11-28).
# Wall time is stretched by other work on the machine; the sources say that this figure wants an idle
# one. Spinning each rank's priced arithmetic in place inside the narrow step (a CPU-time spin at every
# nn.Linear's forward and backward) does not stand for it: a spin touches no memory and fills the cores
# the ranks leave idle, so at 4 ranks on 2 cores it came out below the sum (zero3 on gpt-tiny: 178 ms
# against 194 summed and 220 measured, 2026-11-28).
#
# [Note: ranks sharing cores]
# With more ranks than cores the ranks take turns, and the cores sit idle only while fewer ranks than cores
# can run (the rest wait at a collective). An engine that gathers its parameters unit by unit (zero3, fsdp,
# torch-fsdp) has its ranks meet before every unit's forward and backward; ranks taking turns arrive at each
# meeting apart by more as there is more arithmetic between meetings, so the idle share of the cores stays
# with the step as its arithmetic grows. Measured per rank (the process's CPU seconds a step, every thread,
# against the step's wall time): gpt-tiny's zero3 at 4 ranks on 2 cores kept the cores 79 % busy in the
# 8-token step and 82 % in the real one, torch-fsdp 80 and 85 % (2026-11-28). So for those engines the
# arithmetic added on top stretches by 1 / busy as well as by ranks / cores (`NarrowStep.busy`: the narrow
# step's CPU seconds, all ranks', over cores x wall); summed instead (the idle left as it was in the narrow
# step), their 4-rank rows came out at 0.80-0.91 of the measured step. A data-parallel engine's ranks meet
# once, at the gradients' all-reduce after all the arithmetic, where the idle is how far apart they arrive,
# which does not grow with the arithmetic before: gpt-tiny's ddp kept 79 % of the cores busy in the 8-token
# step and 92 % in the real one, and stretched by 1 / busy its 4-rank row came out at 1.15 of the measured step
# (torch-ddp 1.08), summed at 0.98-1.00. Where each rank has cores of its own the idle is a rank waiting for
# the others, which more arithmetic between the same meetings does not lengthen much: busy is 1 there
# (stretched, the 2-rank steps came out at 1.05-1.17 of the measured ones).
_HOST_HEAD_DIM, _HOST_SEQ, _HOST_STEPS = 2, 8, 9


class _HostSteps:
    """(config, engine) -> the engine's step measured apart from its arithmetic ([Note: the host's work,
    measured]). `price`: a census -> seconds of its arithmetic at this machine's rates (set by cpu_machine)."""

    def __init__(self, world: int):
        self.world, self.cache = world, {}
        self.price: Callable[[Census], float] | None = None

    def __call__(self, cfg, engine: str) -> NarrowStep | None:
        if cfg.model.name != "gpt":
            return None
        if engine not in self.cache:
            self.cache[engine] = self._measure(cfg, engine)
        return self.cache[engine]

    def _narrow(self, cfg, engine: str, tmp: str, world: int, width: bool = True):
        """The config at `_HOST_SEQ` tokens a sample and, with `width`, `_HOST_HEAD_DIM` a head."""
        from shardlab.config import config_from_dict
        from shardlab.models.gpt import GPT_PRESETS
        from shardlab.plan.probe import probe_config

        t = cfg.train
        accumulation = max(1, t.global_batch_size // (t.micro_batch_size * self.world))
        raw = probe_config(cfg, None, t.micro_batch_size, _HOST_SEQ, world, 3 + _HOST_STEPS, accumulation,
                           tmp).to_dict()
        if width:
            heads = raw["model"].get("n_head") or GPT_PRESETS[raw["model"]["preset"]].n_head
            raw["model"]["n_embd"] = heads * _HOST_HEAD_DIM
        raw["parallel"]["strategy"] = engine
        raw["output"]["dir"] = tmp
        return config_from_dict(raw)

    def _measure(self, cfg, engine: str) -> NarrowStep | None:
        if self.world == 1:
            seconds, _ = self._one_rank(cfg, engine, width=True)
            return None if seconds is None else NarrowStep(seconds)
        from shardlab.testing import run_workers  # local processes on a FileStore: nothing listens

        narrow = _narrowed(self, cfg, engine)
        try:
            wall, cpu = run_workers(self.world, _real_group_step, narrow, timeout_s=300.0)[0]
        except RuntimeError:
            return None  # a config the narrow step cannot run: the per-operator fallback
        _, census = self._one_rank(cfg, engine, width=False, census=True)
        if census is None or self.price is None:
            return None
        cores = os.cpu_count() or 1
        shared = self.world * threads_per_rank(self.world) > cores
        stretches = shared and _meets_between_blocks(cfg, engine, self.world) and wall > 0
        busy = min(1.0, sum(cpu) / (cores * wall)) if stretches else 1.0
        return NarrowStep(max(0.0, wall - self.price(census) / busy), busy, collectives=True)

    def _one_rank(self, cfg, engine: str, width: bool, census: bool = False) -> tuple[float | None, Census | None]:
        """The narrow step on one process (a fake group of the world's size, or a real one-rank group for an
        engine that needs one): its median in the thread's CPU time, and with `census` one more step's
        operations (plan/ops.py)."""
        import torch.distributed as dist

        from shardlab.engines import engine_class
        from shardlab.loop.run import build_run
        from shardlab.loop.runtime import Runtime
        from shardlab.loop.train import train_step
        from shardlab.plan.model import init_fake_group
        from shardlab.plan.ops import OpCensus

        if dist.is_initialized():
            return None, None
        fake = engine_class(engine).fake_group_probe
        with tempfile.TemporaryDirectory(prefix="shardlab-host-") as tmp, _threads(1):
            if fake:
                init_fake_group(0, self.world)
            else:  # PyTorch DDP's hook needs a real group: one rank (its host work does not depend on N)
                dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
            try:
                world = self.world if fake else 1   # the real run's micro batches per rank either way
                rt = Runtime(0, 0, world, torch.device("cpu"), "fake" if fake else "gloo")
                run = build_run(self._narrow(cfg, engine, tmp, world, width), rt)
                run.model.train()
                steps = []
                for _ in range(3 if census else 3 + _HOST_STEPS):  # the first steps create the optimizer's state
                    start = time.thread_time()
                    train_step(run)
                    run.state.step += 1
                    steps.append(time.thread_time() - start)
                if not census:
                    return statistics.median(steps[3:]), None
                with OpCensus() as counted:
                    train_step(run)
                return None, counted.census
            finally:
                dist.destroy_process_group()


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
               "memory": f"each kernel replayed here at its arguments; others at {bandwidth / 1e9:.1f} GB/s "
                         "(4 MiB float32 add)",
               "optimizer": "each kernel replayed here at its arguments",
               "host": "the engine's own step measured here at a negligible width (GPT models; others: "
                       f"{host * 1e6:.1f} us per operator, measured here)"}
    if world > 1:
        sources["host"] = (f"the engine's own step measured here at the real width and {_HOST_SEQ} tokens a sample on "
                           f"a real gloo group of {world} local processes, wall time less its own arithmetic: the "
                           "host's work and every collective whole (an idle machine's figure; GPT models; others: "
                           f"{host * 1e6:.1f} us per operator, measured here, and the link)")
    steps = _HostSteps(world)
    machine = Machine("cpu", {"fp32": peak}, bandwidth, host, 1.0, False, sources, set(), _Rates(threads),
                      slowdown=max(1.0, world / cores), host_step=steps)
    steps.price = lambda census: sum(v for k, v in operation_seconds(census, machine).items() if k != "host")
    return machine


def cpu_gpu() -> GPU:
    """This machine as a catalogue entry for the memory verdict: its RAM, and its measured fp32 peak."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    peak, source = measured_peak(torch.device("cpu"), torch.float32)
    return GPU("cpu", ram, True, {"fp32": peak}, 0.0, f"this machine: {source}", intra_node="loopback",
               inter_node="loopback")


def _meets_between_blocks(cfg, engine: str, world: int) -> bool:
    """Whether the engine's ranks meet between its blocks: its step gathers parameters (an all-gather or a
    broadcast in `Plannable.step_traffic`) before each unit's forward and backward ([Note: ranks sharing
    cores]); data-parallel engines meet only at the gradients' all-reduce, after the arithmetic."""
    from shardlab.plan.traffic import comm_plan

    return any(calls and kind in ("all_gather", "broadcast") for kind, _b, calls, _r in comm_plan(cfg, engine, world))


def _narrowed(steps: _HostSteps, cfg, engine: str):
    """The config at the real width and `_HOST_SEQ` tokens a sample (`_HostSteps._narrow`), at the real world
    size: its output directory is each worker's own."""
    with tempfile.TemporaryDirectory(prefix="shardlab-host-") as tmp:
        return steps._narrow(cfg, engine, tmp, steps.world, width=False)


def _real_group_step(rank: int, world: int, cfg) -> tuple[float, list[float]] | None:
    """One rank of the narrow step on the real group (run_workers' gloo group), trained as
    `shardlab train` trains it (loop/train.py's `train`: the hang doctor's records, the step's own
    measurements, releasing the gradients): rank 0's median step (the first left out), and each rank's
    median CPU seconds a step over the same steps (metrics.json's `cpu_seconds_per_step`: every thread of
    its process) ([Note: the host's work, measured])."""
    import dataclasses

    from shardlab.loop.runtime import Runtime
    from shardlab.loop.train import train

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="shardlab-host-") as tmp:
        cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dir=tmp),
                                  checkpoint=dataclasses.replace(cfg.checkpoint, final=False))
        with contextlib.redirect_stdout(io.StringIO()):  # a run's opening lines are not plan's output (--json)
            metrics = train(cfg, Runtime(rank, rank, world, torch.device("cpu"), "gloo"))
    if rank != 0:
        return None
    return metrics["step_time_median_s"], [statistics.median(c[1:] or c) for c in metrics["cpu_seconds_per_step"]]


def _copies(first, build, nbytes: float | None = None) -> list:
    """`first` and more copies from `build()`, COLD_BYTES of them together (at most MOST_COPIES): a timed
    operation cycling through them reads operands beyond the core's own cache."""
    if nbytes is None:
        nbytes = sum(x.nbytes for x in first if isinstance(x, torch.Tensor))
    return [first] + [build() for _ in range(min(MOST_COPIES, int(COLD_BYTES // max(nbytes, 1))) - 1)]
