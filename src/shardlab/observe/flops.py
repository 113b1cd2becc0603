"""FLOPs and the device's peak, for MFU (docs/observability.md) and for plan's step time.

`CountFlops` counts what a step executes, by torch's own formulas: plan's probes count their
step with it (plan/probe.py), and the training loop counts the first step of each run with it
(`StepFlops`, for loop/measurements.py), so a run's FLOPs per token and plan's are the same count of the same step.

`device_peak`: the FLOP/s MFU divides by. A GPU in plan's catalogue: its dense peak in the dtype
matmuls run in under `train.precision` (bf16/fp16 tensor cores, or fp32 CUDA cores: plan/catalogue.py,
with its source). Any other device, the CPU included: this machine's
matmul peak, measured once (the best of a few rounds of square matmuls at the training dtype
and the process's thread count) and cached under the shardlab cache directory, so every run
on the machine divides by the same number ([Note: a peak measured on busy cores]).

[Note: a peak measured on busy cores]
A peak measured while other processes share the cores is low, and every MFU divided by it reads
high (a cached 38 GFLOP/s on cores that do 109 idle gave 114-143 % MFU). Two guards:
- while measuring, each round's CPU share (process CPU time / wall time / threads) tells whether
  the matmuls had the cores: only a round with at least FREE_SHARE counts as the peak, rounds go
  on (up to PEAK_SECONDS) until one has it; a measurement without such a round is used for the
  run, named as measured under load, and not cached, so the next run measures again;
- after the run, a step whose counted FLOP/s exceed the peak proves the peak too low (or the
  count too high): the run says so in `mfu_note` and a warning, and drops the cached figure.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from shardlab.config import TrainConfig

#: Side of the square matmuls the peak is measured with (CPU; a GPU takes 8x), and the rounds.
PEAK_SIDE = 1024
PEAK_ROUNDS = 8
#: a round counts as the peak when its matmuls had this share of their threads' wall time
FREE_SHARE = 0.9
#: how long rounds go on looking for one that had the cores (CPU), before giving up for this run
PEAK_SECONDS = 5.0
#: the longest one CPU matmul of the measurement may take (its side is chosen so)
MATMUL_S = 0.05


class CountFlops(TorchDispatchMode):
    """FLOPs of the step as it runs: every operator torch's flop counter has a formula for
    (matmuls, convolutions, attention), by its shapes, recomputation included (what checkpointing
    runs again is dispatched again; what selective keeps is not). torch's FlopCounterMode is not
    used because it also tracks modules with autograd hooks of its own, which would change what
    the memory tracker beside it measures."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_counter.flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def _cpu_flash_attention_formulas() -> None:
    """torch counts the CUDA attention kernels; on CPU SDPA is
    `_scaled_dot_product_flash_attention_for_cpu`: the same products, counted the same way."""
    aten = torch.ops.aten
    pairs = ((getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None), flop_counter.sdpa_flop_count, 3),
             (getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None),
              flop_counter.sdpa_backward_flop_count, 4))
    for op, count, shapes in pairs:
        if op is None or op in flop_counter.flop_registry:
            continue
        flop_counter.register_flop_formula(op)(
            lambda *a, out_shape=None, _count=count, _n=shapes, **kw: _count(*a[:_n]))


_cpu_flash_attention_formulas()


def _chunked_loss_formula() -> None:
    """torch's chunked cross-entropy (the chunked loss in float32/float64, models/lm_loss.py) is one
    custom operator whose matmuls run inside it: the logits' 2 x tokens x vocabulary x width, and the
    same again for each gradient it computes in its forward (the input's, the weight's)."""
    try:
        import torch.nn.modules.linear_cross_entropy  # noqa: F401  (registers the operator)
    except ImportError:  # torch < 2.13: no such operator, the chunked loss is shardlab's own (models/lm_loss.py)
        return

    op = torch.ops.torch_nn._linear_cross_entropy_batch_chunked
    if op in flop_counter.flop_registry:
        return

    def count(h, w, *rest, out_shape=None, **kw) -> int:
        (n, width), vocab = h, w[0]
        return 2 * n * vocab * width * (1 + int(rest[10]) + int(rest[11]))  # + compute_input_grad, _weight_grad

    flop_counter.register_flop_formula(op)(count)


_chunked_loss_formula()


# -- a run's MFU -------------------------------------------------------------------------------
class StepFlops:
    """MFU ([Note: how MFU is computed]): the FLOPs of the first step this run trains, counted on
    rank 0 (`count` around it), over each step's time and the device's peak. The other ranks'
    object counts nothing and answers None."""

    def __init__(self, run: Any, t: TrainConfig):
        self.samples_rank = t.global_batch_size // run.rt.world_size
        self.tokens_per_sample = run.data.tokens_per_sample
        self.flops: int | None = None
        self.peak: float | None = None
        self.peak_source: str | None = None
        self.note = "trains nothing in this run" if run.state.step >= t.steps else None
        if t.compile:
            self.note = "not counted under train.compile: compiled kernels bypass the dispatcher that counts FLOPs"
        self.counting = run.rt.is_main and self.note is None
        self.device, self.precision = run.rt.device, t.precision
        if self.counting:  # before the first step: measuring the peak (once per machine, cached) is not step time
            self.peak, self.peak_source = device_peak(run.rt.device, t.precision)

    @contextlib.contextmanager
    def count(self) -> Iterator[None]:
        """Around a training step: the first this run trains is counted (rank 0)."""
        if not self.counting:
            yield
            return
        with CountFlops() as counted:
            yield
        self.flops, self.counting = counted.flops, False

    def mfu(self, step_time: float) -> float | None:
        if self.flops is None or not self.peak or step_time <= 0:
            return None
        return self.flops / step_time / self.peak

    def summary(self, step_times: list[float]) -> dict[str, Any]:
        """metrics.json's MFU keys: per step of this run (as step_times_s), their median over the
        steps after the first (as step_time_median_s), and what they come from."""
        per_step = [self.mfu(s) for s in step_times]
        measured = [m for m in per_step[1:] or per_step if m is not None]
        if measured and max(measured) > 1:
            self.note = self._peak_too_low(max(measured))
        per_sample = self.flops / self.samples_rank if self.flops is not None else None
        return {"mfu": statistics.median(measured) if measured else None,
                "mfu_per_step": per_step if self.flops is not None else None,
                "flops_per_step_per_rank": self.flops,
                "flops_per_sample": per_sample,
                "flops_per_token": per_sample / self.tokens_per_sample
                if per_sample is not None and self.tokens_per_sample else None,
                "peak_flops_per_s": self.peak, "peak_flops_source": self.peak_source,
                "mfu_note": self.note}

    def _peak_too_low(self, highest: float) -> str:
        """A step ran faster than the peak ([Note: a peak measured on busy cores]): say so, and drop
        a cached figure so that the next run measures again."""
        measured = "measured" in (self.peak_source or "")
        note = (f"a step reached {highest:.0%} of the peak, so the peak ({self.peak / 1e9:.1f} GFLOP/s: "
                f"{self.peak_source}) is too low" + (": measured on busy cores, or the run's matmul shapes run faster in "
                                                     "this dtype than the measurement's" if measured else
                                                     " or the step's FLOPs counted above what ran"))
        if "cached in" in (self.peak_source or ""):
            peak_cache_path(self.device, compute_dtype(self.precision)).unlink(missing_ok=True)
            note += "; the cached figure is removed and the next run measures it again"
        print(f"warning: MFU: {note}", file=sys.stderr, flush=True)
        return note


# -- the peak -------------------------------------------------------------------------------------
def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls run in under `train.precision` (autocast's)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def device_peak(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s of one rank's device, where the figure comes from)."""
    if device.type == "cuda":
        known = _catalogue_gpu(device)
        dtype = {"bf16": "bf16", "fp16": "fp16"}.get(precision, "fp32")  # fp32 matmuls: CUDA cores (no tf32)
        if known is not None and dtype in known.peaks:
            return known.peaks[dtype], f"plan's catalogue: {known.name}, dense {dtype} ({known.source[:80]}...)"
    return measured_peak(device, compute_dtype(precision))


def _catalogue_gpu(device: torch.device):
    """The catalogue's GPU this device is (by name; two of one name told apart by memory), else None."""
    # deferred: plan's package imports its probes; only a CUDA run asks
    from shardlab.plan.catalogue import GPUS

    name = torch.cuda.get_device_name(device).upper()
    memory = torch.cuda.get_device_properties(device).total_memory
    matches = [g for key, g in GPUS.items() if key.split("-")[0].upper() in name.split()]
    return min(matches, key=lambda g: abs(g.memory_bytes - memory)) if matches else None


def peak_cache_path(device: torch.device, dtype: torch.dtype) -> Path:
    """Where this machine's measured peak in `dtype` at this process's threads is cached."""
    from shardlab.data.corpus import cache_dir  # deferred: the data package is heavy to import

    key = hashlib.sha256(json.dumps(_peak_key(device, dtype), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "peaks" / f"{key}.json"


def _peak_key(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    return {"device": _device_label(device), "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "torch": torch.__version__.split("+")[0]}


def measured_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """This machine's matmul peak in `dtype` at this process's threads: read from the cache, or
    measured now (about a second; [Note: a peak measured on busy cores]) and cached."""
    what = _peak_key(device, dtype)
    path = peak_cache_path(device, dtype)
    label = f"measured matmul peak on this machine ({what['device']}, {what['dtype']}, {what['threads']} thread(s))"
    try:
        return float(json.loads(path.read_text())["peak_flops"]), f"{label}, cached in {path}"
    except (OSError, ValueError, KeyError):
        pass
    flops, share = _time_matmuls(device, dtype)
    if share < FREE_SHARE:
        return flops, (f"{label}, measured under load (the best round had {share:.0%} of its threads' time): "
                       f"not cached, MFU may read high")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**what, "peak_flops": flops, "cpu_share": share, "measured": time.time()}, indent=2))
    os.replace(tmp, path)
    return flops, f"{label}, cached in {path}"


def _device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"cpu: {model or platform.processor() or platform.machine()}"


def _time_matmuls(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(the best FLOP/s of rounds of square matmuls (2 n^3 FLOPs each) that had the cores, the CPU
    share of the round it comes from): PEAK_ROUNDS rounds, more while none had FREE_SHARE of its
    threads' time, never past PEAK_SECONDS once two are in; without such a round, the best of all
    and its share. On a CPU the side is the largest power of two up to PEAK_SIDE whose matmul takes
    under MATMUL_S: a dtype the CPU computes slowly (float16 here: 0.5 GFLOP/s, 4 s for one 1024
    matmul) gets smaller matrices, not a minute of measuring."""
    cuda = device.type == "cuda"
    # its own generator: measured in a run when the cache misses, it must not move the run's random
    # stream (dropout masks would then depend on whether this machine's peak was cached)
    g = torch.Generator(device=device).manual_seed(0)
    n = PEAK_SIDE * 8 if cuda else _cpu_side(dtype, g)
    a = torch.randn(n, n, device=device, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, generator=g).to(dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    per_round, threads = (10, 1) if cuda else (2, torch.get_num_threads())
    rounds: list[tuple[float, float]] = []   # (FLOP/s, CPU share)
    start = time.perf_counter()
    for r in itertools.count():
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(per_round):
            torch.mm(a, b)
        sync()
        t1, c1 = time.perf_counter(), time.process_time()   # read together: both span the same round
        wall = t1 - t0
        # a GPU's kernels run whatever the host's cores do: its rounds count as free
        share = 1.0 if cuda else min(1.0, (c1 - c0) / wall / threads)
        if r:  # the first round warms up
            rounds.append((per_round * 2 * n**3 / wall, share))
        free = any(s >= FREE_SHARE for _, s in rounds)
        late = len(rounds) >= 2 and time.perf_counter() - start > PEAK_SECONDS
        if (len(rounds) >= PEAK_ROUNDS and free) or late:
            break
    return max([r for r in rounds if r[1] >= FREE_SHARE] or rounds)


def _cpu_side(dtype: torch.dtype, g: torch.Generator) -> int:
    """The largest power of two up to PEAK_SIDE (from 128) whose matmul in `dtype` takes under MATMUL_S."""
    n = min(128, PEAK_SIDE)
    while n < PEAK_SIDE:
        m = torch.randn(n, n, generator=g).to(dtype)
        torch.mm(m, m)   # the first call of a size sets up its kernel
        t0 = time.perf_counter()
        torch.mm(m, m)
        if (time.perf_counter() - t0) * 8 > MATMUL_S:   # twice the side: 8 times the work
            break
        n *= 2
    return n
