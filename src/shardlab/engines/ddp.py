"""`ddp`: data parallelism from scratch, every rank holding the whole model.

At wrap, a meta model gets real storage (initialized as a direct build would be) and every
parameter and buffer is broadcast from rank 0, so all replicas start identical. Then, in the
order a step meets it:

    backward         the trainable parameters' gradients, in buckets of about
                     `bucket_size_bytes` in reverse registration order (roughly the order
                     backward produces them): each gradient, once final, is copied into its
                     bucket's flat buffer, and a full bucket is all-reduced (averaged)
                     asynchronously, overlapping the backward of earlier layers
    end of backward  reduce the buckets left, wait for all, point each `p.grad` at its
                     averaged slice of its bucket ([Note: gradients as bucket views])

The optimizer then takes the same step on every rank, which keeps the replicas identical.
Frozen parameters are in no bucket. Memory, traffic and how it relates to PyTorch's DDP:
docs/engines.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardlab.engines import _hooks
from shardlab.engines import collectives as C
from shardlab.engines.api import Engine, MixedPrecision, materialize_whole_
from shardlab.engines.measuring import Measurable
from shardlab.engines.planning import Collective, ModelTraffic, Plannable, bucketed_all_reduce

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass
class _Bucket:
    """A run of parameters whose gradients travel in one all-reduce."""

    params: list[nn.Parameter]
    offsets: list[int]                    # element offset of each parameter in `buffer`
    buffer: torch.Tensor                  # flat, in the reduce dtype
    ready: set[int] = field(default_factory=set)   # indices (into params) whose grad is copied in
    handle: Any = None                    # the async all-reduce's Work, once launched
    launched: bool = False

    def slot(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i]:self.offsets[i] + p.numel()].view(p.shape)


class DDPEngine(Engine, Plannable, Measurable):
    """bucket_size_bytes: target bucket size (default 25 MiB, as PyTorch's DDP).
    mixed_precision: only its `reduce_dtype` applies: gradients are communicated in that dtype
    and cast back. Parameters, compute and gradients stay in their own dtype (a low-precision
    compute copy is what `zero3`/`fsdp` offer; use torch.autocast for DDP)."""

    grads_sharded = False
    options = ("bucket_size_bytes", "mixed_precision")

    @classmethod
    def step_traffic(cls, model: ModelTraffic, options: Mapping[str, Any]) -> list[Collective]:
        return bucketed_all_reduce(model, options.get("bucket_size_bytes", DEFAULT_BUCKET_BYTES))

    def __init__(self, module: nn.Module, *, bucket_size_bytes: int = DEFAULT_BUCKET_BYTES,
                 mixed_precision: Any = None, **kw: Any):
        super().__init__(module, **kw)
        self.counter = C.CommCounter()
        self.mixed_precision = MixedPrecision.parse(mixed_precision)
        self.reduce_dtype = self.mixed_precision.reduce_dtype if self.mixed_precision else None
        materialize_whole_(module, self.device)
        _hooks.broadcast_from_rank0([*module.parameters(), *module.buffers()], self.group, self.counter)

        params = [p for p in self.local_parameters() if p.requires_grad]
        self.buckets = self._make_buckets(list(reversed(params)), int(bucket_size_bytes))
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.sync_grads = True
        self._next_to_launch = 0          # buckets launch strictly in index order (see Note)
        self._backward_end = _hooks.BackwardEnd(self._finish_backward)
        for p in params:
            p.register_post_accumulate_grad_hook(_hooks.weak_hook(self._on_grad_ready))

    # -- setup ----------------------------------------------------------------------------------
    def _make_buckets(self, params: list[nn.Parameter], cap: int) -> list[_Bucket]:
        """Greedy runs of consecutive parameters (same dtype and device) up to `cap` bytes.
        A parameter larger than `cap` gets a bucket of its own."""
        runs: list[list[nn.Parameter]] = []
        size = 0
        for p in params:
            nbytes = p.numel() * torch.empty((), dtype=self.reduce_dtype or p.dtype).element_size()
            fits = bool(runs) and size + nbytes <= cap
            same_kind = bool(runs) and runs[-1][0].dtype == p.dtype and runs[-1][0].device == p.device
            if not (fits and same_kind):
                runs.append([])
                size = 0
            runs[-1].append(p)
            size += nbytes
        buckets = []
        for run in runs:
            offsets, total = [], 0
            for p in run:
                offsets.append(total)
                total += p.numel()
            buffer = torch.zeros(total, dtype=self.reduce_dtype or run[0].dtype, device=run[0].device)
            buckets.append(_Bucket(run, offsets, buffer))
        return buckets

    # -- backward -------------------------------------------------------------------------------
    # Each parameter's post-accumulate-grad hook fires once per backward, with every use
    # summed ([Note: when the hooks fire], engines/_hooks.py): GPT's tied embedding and head are
    # one Parameter, one hook. An activation-checkpointing recompute builds a throwaway graph
    # that is never backpropagated, so it fires no hooks. Inside `no_sync` the hook does
    # nothing: `p.grad` keeps accumulating, and the first synced backward all-reduces the sum.

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self.sync_grads:
            return
        self._backward_end.arm()  # the first hook of this backward arranges to wait at its end
        bucket, i = self._where[id(p)]
        if bucket.launched:
            raise RuntimeError("ddp: a gradient arrived for a bucket already reduced in this backward "
                               "(reentrant backward inside forward is not supported)")
        if p.grad.is_sparse:
            raise RuntimeError("ddp: sparse gradients are not supported")
        slot = bucket.slot(i)
        if not _hooks.same_memory(p.grad, slot):  # already in place when p.grad is the bucket view
            slot.copy_(p.grad)
        bucket.ready.add(i)
        self._launch_ready_buckets()

    # [Note: why buckets launch in index order]
    # Collectives must be issued in the same order on every rank, or ranks pair up the
    # wrong tensors (or hang). Autograd's order of finishing gradients is the same on every
    # rank only if the graphs are the same; a data-dependent branch could make bucket 3
    # fill before bucket 2 on one rank. Launching strictly in bucket order (a full bucket
    # waits for the ones before it) makes the sequence of all-reduces identical everywhere.

    def _launch_ready_buckets(self) -> None:
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        # averaged, never summed: [Note: why average] (engines/api.py)
        bucket.handle = C.all_reduce(bucket.buffer, self.group, average=True, async_op=True, counter=self.counter)
        bucket.launched = True
        self._next_to_launch += 1

    # At the end of backward ([Note: why we wait where we wait], engines/_hooks.py): parameters
    # that got no gradient in this backward still have a slot in a bucket the other ranks may
    # be reducing: their slot is zeroed and the bucket is reduced here, so every rank issues
    # the same all-reduces. Afterwards they hold the average of the ranks that did use them
    # (zeros if none did). Then every bucket is waited for.

    @torch.no_grad()
    def _finish_backward(self) -> None:
        for bucket in self.buckets[self._next_to_launch:]:
            for i in range(len(bucket.params)):
                if i not in bucket.ready:
                    bucket.slot(i).zero_()
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            for i, p in enumerate(bucket.params):
                reduced = bucket.slot(i)
                if reduced.dtype == p.dtype:
                    p.grad = reduced  # see [Note: gradients as bucket views]
                else:  # communicated in a lower precision: cast back into a gradient of p's dtype
                    if p.grad is None or _hooks.same_memory(p.grad, reduced):
                        p.grad = torch.empty_like(p)
                    p.grad.copy_(reduced)
            bucket.ready.clear()
            bucket.handle = None
            bucket.launched = False
        self._next_to_launch = 0

    # [Note: gradients as bucket views]
    # After the all-reduce, `p.grad` becomes a view into its bucket instead of receiving a
    # copy (PyTorch's DDP calls this gradient_as_bucket_view): no copy back, and gradients
    # and buckets share one 4Psi buffer. Autograd writes the next backward's gradient into a
    # fresh tensor when the optimizer set grads to None (copied into the bucket when ready,
    # freed at zero_grad), or accumulates into the view itself otherwise (then nothing to copy).

    # -- Measurable (engines/measuring.py) ---------------------------------------------------------
    def comm_counters(self) -> list[C.CommCounter]:
        return [self.counter]

    def memory_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for b in self.buckets:
            yield "comm", b.buffer                     # "grads" once `.grad` are views into it
