"""The operations of a probed step, by kind, for plan's clock (plan/clock.py): what the fake-tensor probe
dispatches, recorded as it runs (`OpCensus`), and scaled to the real depth and accumulation like the
step's FLOPs (plan/scaling.py).

A record is (kind, op, dtype, shape, FLOPs of one call, bytes one call reads and writes, calls):
- "matmul": an operator torch's flop counter has a formula for, attention aside (mm, addmm, bmm, the
  chunked loss's fused matmuls); shape: its operands' shapes, so the clock can rate it by shape;
- "attention": the scaled-dot-product kernels (forward and backward); shape: query, key, value;
- "optimizer": the kernels of the optimizer's step (AdamW over the shards), told by torch's global
  optimizer-step hooks, and any `_foreach_*` / fused optimizer kernel;
- "memory": every other kernel that moves data (elementwise, norms, softmax, casts, copies); shape ();
- "view": operators whose outputs alias an input (views, reshapes), return no tensor (prim::device, size
  queries) or allocate without writing (empty): no data moves, a dispatch still costs;
- collectives (c10d) are not recorded: the link model prices them (plan/traffic.py).
Matmuls and attention are recorded by their operands' shapes; memory and optimizer kernels by their
operator and arguments (`arg_spec`: each tensor's shape and dtype, the other values as they are), so
that a machine that times them (`--gpu cpu`: a CPU's GELU or layer norm is bound by arithmetic, not
by its bytes) can replay each as it ran; a GPU prices them by their bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils import flop_counter
from torch.utils._pytree import tree_leaves

from shardlab.observe.flops import CountFlops

#: One record: (kind, op, dtype, shape, flops per call, bytes per call) -> calls.
Census = dict[tuple, float]

KINDS = ("matmul", "attention", "memory", "optimizer", "view")
#: operators that move no data: allocations whose memory nobody writes yet, storage resizes
_NO_DATA = ("empty", "new_empty", "resize_", "set_", "_local_scalar_dense")
#: operators that read only the rows they return (a lookup into a table)
_READS_ROWS = ("embedding", "index_select", "gather")


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float64: "fp64"}.get(dtype, str(dtype).removeprefix("torch."))


def _tensors(values: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]


def _is_view(func) -> bool:
    """Every output aliases an input without writing it (a view, a reshape of contiguous memory)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), dtype_name(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_spec(v) for v in value)
    if isinstance(value, torch.dtype):
        return ("D", dtype_name(value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(type(value).__name__)


def arg_spec(args: tuple, kwargs: dict) -> tuple:
    """An operator's arguments as hashable data to replay it (plan/cpu.py): () where one cannot be told
    (a device, a layout, a generator), whose kernel is then priced by its bytes."""
    try:
        return (_spec(args), tuple((k, _spec(v)) for k, v in sorted(kwargs.items()) if k != "device"))
    except TypeError:
        return ()


def kind_of(func) -> str | None:
    name = func._overloadpacket.__name__
    namespace = func.namespace
    if namespace in ("c10d", "_c10d_functional", "_dtensor"):
        return None
    if "attention" in name:
        return "attention"
    if func._overloadpacket in flop_counter.flop_registry:
        return "matmul"
    if name.startswith("_foreach") or name.startswith("_fused_adam") or name.startswith("_fused_sgd"):
        return "optimizer"
    return "view" if _is_view(func) else "memory"


class OpCensus(CountFlops):
    """`CountFlops` (the step's FLOPs, as everywhere) that also records each operator it sees (module
    docstring). `census`: the records, one step's worth."""

    def __init__(self) -> None:
        super().__init__()
        self.census: Census = {}
        self.in_optimizer = False
        self._hooks: list = []

    def __enter__(self):
        # every kernel of an optimizer's step is the optimizer's, whichever implementation it takes
        # (foreach on CUDA, a loop of per-tensor kernels on CPU)
        self._hooks = [register_optimizer_step_pre_hook(lambda *a: setattr(self, "in_optimizer", True)),
                       register_optimizer_step_post_hook(lambda *a: setattr(self, "in_optimizer", False))]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = self.flops
        out = super().__torch_dispatch__(func, types, args, kwargs)
        kind = kind_of(func)
        if kind == "memory" and self.in_optimizer:
            kind = "optimizer"
        if kind is None:
            return out
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        name = func._overloadpacket.__name__
        if not outputs or name.startswith(_NO_DATA):  # a query (prim::device, sizes) or an uninitialized allocation
            kind = "view"
        dtype = dtype_name(inputs[0].dtype if inputs else outputs[0].dtype if outputs else torch.float32)
        if kind == "view":
            moved = 0
        elif name in _READS_ROWS:  # reads the rows it returns, not the whole table
            moved = 2 * sum(t.numel() * t.element_size() for t in outputs)
        else:
            moved = sum(t.numel() * t.element_size() for t in inputs + outputs)
        shape: tuple = ()
        op = func._overloadpacket.__name__
        if kind in ("matmul", "attention"):  # the operands (a backward's first input is the output's gradient)
            first = 1 if kind == "attention" and func._overloadpacket.__name__.endswith("backward") else 0
            shape = tuple(tuple(t.shape) for t in inputs[first:first + 3])
        elif kind in ("memory", "optimizer"):
            op, shape = str(func), arg_spec(args, kwargs)
        else:
            op = ""
        key = (kind, op, dtype, shape, self.flops - before, moved)
        self.census[key] = self.census.get(key, 0) + 1
        return out


def extrapolate(hi: Census, lo: Census, blocks: float) -> Census:
    """A census at the real depth from two probe depths: each record's calls linear in depth, as the
    step's FLOPs are (a block dispatches the same kernels as every other block)."""
    out = {}
    for key in hi.keys() | lo.keys():
        calls = hi.get(key, 0) + blocks * (hi.get(key, 0) - lo.get(key, 0))
        if calls > 0:
            out[key] = calls
    return out


def scale_micro_batches(census: Census, factor: float) -> Census:
    """The census of a step with `factor` times the probe's micro batches: everything but the
    optimizer's step (once per step) repeats per micro batch."""
    return {k: calls * (1 if k[0] == "optimizer" else factor) for k, calls in census.items()}


def totals(census: Census) -> dict[str, dict[str, float]]:
    """kind -> {calls, flops, bytes}: what the report and the JSON show of a census."""
    out = {k: {"calls": 0.0, "flops": 0.0, "bytes": 0.0} for k in KINDS}
    for (kind, _op, _dtype, _shape, flops, moved), calls in census.items():
        out[kind]["calls"] += calls
        out[kind]["flops"] += flops * calls
        out[kind]["bytes"] += moved * calls
    return out
