"""plan's clock: one rank's step time from the operations of the probed step (plan/ops.py), each at
what the device does for that kind of operation, beside the engine's collectives over the link.

[Note: plan's clock]
A step's compute is the sum of its operations' times, each by what bounds it:
- a matmul (mm, addmm, bmm, the chunked loss's fused products): by the roofline, the larger of its
  FLOPs at the matmul ceiling of its dtype and the bytes it reads and writes at memory bandwidth, so
  a skinny product (a small micro batch against a wide weight) is priced by its bytes, a square one by
  its FLOPs. The ceiling is the dtype's data-sheet peak, or for bf16/fp16 the fastest matmul anyone
  measured on that GPU (`GPU.achievable_half`, MAMF: 80-87 % of the data sheet on A100/H100) where
  such a measurement is known; fp32 runs on the CUDA cores at their peak (PyTorch's default keeps
  fp32 matmuls out of tf32, and shardlab never turns tf32 on);
- attention: by its implementation's share of the peak (`ATTENTION_SHARE`): FlashAttention-2, the
  kernel PyTorch's SDPA runs in bf16/fp16, reaches 50-73 % of an A100's peak (Dao, "FlashAttention-2",
  arXiv:2307.08691) and about 35 % of an H100's (Shah et al., "FlashAttention-3", arXiv:2407.08608);
- everything else that moves data (elementwise, norms, softmax, casts, the optimizer's foreach
  kernels): its bytes at the memory bandwidth (on a CPU, where GELU, layer norm or a division are
  bound by arithmetic more than by bytes, each kernel is replayed at its arguments and timed);
- every dispatched operator, views included, costs the host `host_op_s` (eager PyTorch launches
  one kernel per operator): a GPU's kernels run behind the host, so the compute is the larger of the
  device's sum and the host's, which is what makes a tiny model on a big GPU host-bound.
On this machine (`--gpu cpu`, plan/cpu.py) every figure is measured here instead: each matmul shape of
the step timed as it is, attention timed at its shape, bandwidth measured, and the host's whole work
(every operator's dispatch and the Python between them: the modules, the engine's hooks and per-parameter
bookkeeping, each collective's launch, the optimizer's per-tensor loop, autograd's graph) measured on the
engine's own step at a negligible width ([Note: the host's work, measured] in plan/cpu.py), where a
count of operators at one operator's cost would miss the Python the sharded engines run between them.
Beyond one rank that step runs on a real group at the real width, so it holds the collectives whole, bytes
included, and their waits; where ranks share cores, their arithmetic stretches by the share of the cores that
step left idle ([Note: ranks sharing cores] in plan/cpu.py).
Communication is otherwise the link model over the engine's collectives (plan/traffic.py). On a GPU the
collectives run beside compute on their own stream, except the first gather of a step (nothing to
compute before it) and the last reduce (nothing left to compute after it): step = exposed + max(compute,
rest of comm). On a CPU the collectives take the same cores as compute (gloo's threads copy the bytes), so
they add, and more ranks than cores stretch them as they stretch compute (`Machine.slowdown`).
Without a probe at the real shape the compute is the FLOPs (6 x parameters x tokens, plus what
checkpointing recomputes) at the matmul ceiling, and the report says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shardlab.plan.catalogue import GPU
from shardlab.plan.ops import Census

#: Seconds of host time per dispatched operator on a GPU host (eager PyTorch: dispatch and a kernel
#: launch). An assumption of the order commonly quoted (a few microseconds), not measured here.
GPU_HOST_OP_S = 5e-6
#: Attention kernels' share of the dense peak, by GPU generation (bf16/fp16: FlashAttention-2 in SDPA).
#: A100: the low end of FA-2's 50-73 % (its paper), the backward, 2.5 x the forward's FLOPs, being the
#: slower; H100/H200: FA-2's ~35 % (the FA-3 paper); T4/L4: no figure found, A100's assumed.
ATTENTION_SHARE = {"T4": 0.5, "L4": 0.5, "A100-40": 0.5, "A100-80": 0.5, "H100": 0.35, "H100-96": 0.35,
                   "H200": 0.35}
ATTENTION_SOURCE = {"A100-40": "FlashAttention-2 paper (arXiv:2307.08691): 50-73 % of A100's peak",
                    "A100-80": "FlashAttention-2 paper (arXiv:2307.08691): 50-73 % of A100's peak",
                    "H100": "FlashAttention-3 paper (arXiv:2407.08608): FA-2 at ~35 % of H100's peak",
                    "H100-96": "FlashAttention-3 paper (arXiv:2407.08608): FA-2 at ~35 % of H100's peak",
                    "H200": "FlashAttention-3 paper (arXiv:2407.08608): FA-2 at ~35 % of H100's peak"}


@dataclass(frozen=True)
class NarrowStep:
    """What a machine measured of an engine's own step apart from its arithmetic (plan/cpu.py, [Note: the
    host's work, measured]): `seconds`, the step less its arithmetic (the host's work; with `collectives`,
    every collective whole too: latency, bytes, waiting for the other ranks); `busy`, the share of the cores
    the ranks kept busy where they share them (1: each rank has cores of its own), by which their arithmetic
    stretches too ([Note: ranks sharing cores] in plan/cpu.py)."""
    seconds: float
    busy: float = 1.0
    collectives: bool = False


@dataclass
class Machine:
    """What the clock knows of one rank's device: the matmul ceiling per dtype, memory bandwidth, the
    host's cost per operator, how attention runs; `sources` says where each came from, `assumed` which
    of them nobody measured. `rate`: (kind, op, dtype, shape, work) -> work per second measured for that
    operation (this machine): FLOP/s for matmul and attention (work: its FLOPs), bytes/s for the others
    (work: its bytes); None: not measured (a GPU: ceilings and roofline)."""
    name: str
    ceilings: dict[str, float]
    memory_bandwidth: float
    host_op_s: float
    attention_share: float               # of the matmul ceiling in the same dtype
    overlaps: bool                       # collectives run beside compute (a GPU's streams), or take its cores
    sources: dict[str, str] = field(default_factory=dict)
    assumed: set[str] = field(default_factory=set)
    rate: Callable[..., float | None] | None = None
    slowdown: float = 1.0                # more ranks than cores (a CPU): compute and the collectives' bytes
                                         # each take ranks / cores as long
    #: (config, engine) -> the engine's step measured apart from its arithmetic (this machine), else None
    host_step: Callable[..., NarrowStep | None] | None = None

    def ceiling(self, dtype: str) -> float:
        return self.ceilings.get(dtype) or self.ceilings["fp32"]


def gpu_machine(gpu: GPU) -> Machine:
    """A catalogue GPU as the clock sees it: ceilings by dtype (MAMF for bf16/fp16 where measured)."""
    ceilings = {"fp32": gpu.peak("fp32")}
    sources = {"matmul fp32": f"{gpu.name} data sheet fp32 (CUDA cores) {gpu.peak('fp32') / 1e12:g} TFLOP/s "
                              "(no measured ceiling)"}
    assumed = {"matmul fp32", "memory", "optimizer", "host"}
    for half in ("bf16", "fp16"):
        if half not in gpu.peaks:
            continue
        if gpu.achievable_half:
            ceilings[half] = gpu.achievable_half[0]
            sources[f"matmul {half}"] = (f"{gpu.name} measured matmul ceiling {gpu.achievable_half[0] / 1e12:g} "
                                         f"TFLOP/s of {gpu.peak(half) / 1e12:g} ({gpu.achievable_half[1]})")
        else:
            ceilings[half] = gpu.peak(half)
            sources[f"matmul {half}"] = f"{gpu.name} data sheet {half} {gpu.peak(half) / 1e12:g} TFLOP/s (no measured ceiling)"
            assumed.add(f"matmul {half}")
    share = ATTENTION_SHARE.get(gpu.name, 0.5)
    sources["attention"] = f"{share:.0%} of the data sheet's peak: " + ATTENTION_SOURCE.get(gpu.name, "assumed")
    if gpu.name not in ATTENTION_SOURCE:
        assumed.add("attention")
    sources["memory"] = f"{gpu.name} data sheet bandwidth {gpu.memory_bandwidth / 1e9:g} GB/s, reached in full"
    sources["optimizer"] = sources["memory"]
    sources["host"] = f"{GPU_HOST_OP_S * 1e6:g} us per operator (assumed)"
    # the papers' shares are of the data sheet's peak, the clock applies them to the ceiling: rescaled
    half = "bf16" if "bf16" in ceilings else "fp16" if "fp16" in ceilings else "fp32"
    of_ceiling = share * gpu.peak(half) / ceilings[half]
    return Machine(gpu.name, ceilings, gpu.memory_bandwidth, GPU_HOST_OP_S, of_ceiling, True, sources, assumed)


def operation_seconds(census: Census, m: Machine, cfg=None, engine: str | None = None) -> dict[str, float]:
    """Seconds of one rank's step by kind of operation: matmul, attention, memory, optimizer (device
    time) and host (dispatch, and on a machine that measures it the Python between operators: `cfg` and
    `engine` say whose step), before the host and device are overlapped (`compute_seconds`)."""
    out = dict.fromkeys(("matmul", "attention", "memory", "optimizer", "host"), 0.0)
    for (kind, op, dtype, shape, flops, moved), calls in census.items():
        out["host"] += calls * m.host_op_s * m.slowdown
        if kind == "view":
            continue
        by_bytes = moved / m.memory_bandwidth
        if kind in ("matmul", "attention"):
            measured = m.rate(kind, op, dtype, shape, flops) if m.rate else None
            if measured:
                seconds = flops / measured
            else:
                ceiling = m.ceiling(dtype) * (m.attention_share if kind == "attention" else 1.0)
                seconds = max(flops / ceiling, by_bytes)
        else:  # bytes/s this kernel reaches where the machine replays it (a CPU), else the bandwidth
            measured = m.rate(kind, op, dtype, shape, moved) if m.rate and shape and moved else None
            seconds = moved / measured if measured else by_bytes
        out[kind] += calls * seconds * m.slowdown
    narrow = narrow_step(m, cfg, engine)
    if narrow is not None:
        for kind in ("matmul", "attention", "memory", "optimizer"):
            out[kind] /= narrow.busy
        # measured on the ranks themselves (collectives), else in one rank's CPU time: stretched as above
        out["host"] = narrow.seconds if narrow.collectives else narrow.seconds * m.slowdown
    return out


def narrow_step(m: Machine, cfg=None, engine: str | None = None) -> NarrowStep | None:
    """The machine's measurement of `engine`'s step apart from its arithmetic, where it makes one."""
    return m.host_step(cfg, engine) if m.host_step and cfg is not None and engine else None


def compute_seconds(parts: dict[str, float], m: Machine) -> float:
    """The device's time and the host's overlap on a GPU (kernels queue behind the host); on a CPU
    the host is the device: they add."""
    device = parts["matmul"] + parts["attention"] + parts["memory"] + parts["optimizer"]
    return max(device, parts["host"]) if m.overlaps else device + parts["host"]


def step_seconds(compute: float, comm: float, exposed: float, m: Machine) -> float:
    """The step from its compute and its communication ([Note: plan's clock])."""
    if not m.overlaps:
        return compute + comm
    return exposed + max(compute, comm - exposed)


def main_dtype(census: Census) -> str | None:
    """The dtype most of the step's matmul FLOPs run in."""
    flops: dict[str, float] = {}
    for (kind, _op, dtype, _shape, f, _moved), calls in census.items():
        if kind == "matmul":
            flops[dtype] = flops.get(dtype, 0.0) + f * calls
    return max(flops, key=lambda d: flops[d]) if flops else None


def least_sure(parts: dict[str, float], comm_s: float, m: Machine, counted: bool, dtype: str | None = None) -> str:
    """Where the clock is least sure: the part that dominates the step, and what it assumed for it (for
    matmuls, the figure of the dtype most of them run in)."""
    named = {**parts, "comm": comm_s}
    top = max(named, key=lambda k: named[k])
    total = sum(named.values()) or 1.0
    share = f"{top} is {named[top] / total:.0%} of the parts"
    if not counted:
        return share + "; no probe at the real shape: FLOPs from 6 x parameters x tokens at the matmul ceiling"
    if top == "comm":
        return share + "; the link's alpha-beta constants (plan/catalogue.py, INTERCONNECTS) set it"
    key = f"{top} {dtype}" if f"{top} {dtype}" in m.sources else top
    if key not in m.sources:
        return share
    sure = "assumed" if key in m.assumed or top in m.assumed else "measured or cited"
    return share + f" ({sure}: {m.sources[key]})"
