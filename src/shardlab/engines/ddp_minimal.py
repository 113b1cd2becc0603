"""`ddp-minimal`: data parallelism in its plainest form. Read it before engines/ddp.py.

The algorithm
-------------
1. At wrap, every rank builds the whole model (a meta model is materialized exactly as a
   direct build would be) and takes rank 0's values, so all replicas start identical.
2. Each step, each rank runs forward and backward on its own slice of the global batch;
   autograd leaves this rank's gradient in every `p.grad`.
3. When backward has produced its last gradient, every gradient is all-reduced and divided
   by N, so every rank holds the gradient of the global mean loss ([Note: why average],
   engines/api.py). The optimizer then takes the same step on every rank and the replicas
   stay equal, with no further communication.
4. Inside `no_sync()` step 3 is skipped: `p.grad` keeps summing the micro batches, and the
   first backward outside it averages the sum.

Memory per rank (fp32 AdamW, Ψ parameters): 4Ψ parameters + 4Ψ gradients + 8Ψ moments =
16Ψ bytes at every N. Traffic per step: every gradient all-reduced once, 2(N-1)/N × 4Ψ
bytes sent per rank on a ring.

[Note: one all-reduce per parameter, after backward]
Each trainable parameter's gradient is all-reduced on its own, in place in `p.grad`, all of
them launched at the end of backward (the callback that `loss.backward()` runs after its
last node: [Note: why we wait where we wait] in engines/_hooks.py) in registration order, then
waited for. Two things make this the simplest correct choice:
- the order is the same on every rank whatever order autograd finished the gradients in,
  so the collectives pair up (a parameter unused on this rank is all-reduced as zeros);
- nothing is copied: no flat buffer, no views.
Its costs are what engines/ddp.py removes: one call per tensor (on a GPU each call has a
latency of its own, which buckets of ~25 MiB amortize), and no overlap (the full engine
launches each bucket the moment its gradients are in, so the all-reduce of late layers
runs while autograd computes the early ones).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardlab.engines import collectives as C
from shardlab.engines.api import Engine, materialize_whole_
from shardlab.engines.measuring import Measurable
from shardlab.engines.planning import Collective, ModelTraffic, Plannable


class MinimalDDPEngine(Engine, Plannable, Measurable):
    grads_sharded = False

    def __init__(self, module: nn.Module, **kw: Any):
        super().__init__(module, **kw)
        self.counter = C.CommCounter()  # every collective below counts its bytes (shardlab bench)
        materialize_whole_(module, self.device)  # a meta model gets its values as a direct build would
        for t in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values():  # tied: once
            C.broadcast(t.data, 0, self.group, counter=self.counter)  # every replica starts as rank 0's
        self.trainable = [p for p in self.local_parameters() if p.requires_grad]
        self._end_queued = False
        engine = weakref.ref(self)  # a hook on a parameter, held from C++, must not keep the engine alive

        def hook(p: torch.Tensor) -> None:
            if engine() is not None:
                engine()._on_gradient(p)

        for p in self.trainable:  # fires once per backward, when every use of p is summed into p.grad
            p.register_post_accumulate_grad_hook(hook)

    def _on_gradient(self, _param: torch.Tensor) -> None:
        if self.sync_grads and not self._end_queued:
            # the first gradient of this backward asks autograd to call us after its last node
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average_gradients)

    @torch.no_grad()
    def _average_gradients(self) -> None:
        self._end_queued = False
        handles = []
        for p in self.trainable:
            if p.grad is None:  # unused in this backward here, maybe not on other ranks
                p.grad = torch.zeros_like(p)
            handles.append(C.all_reduce(p.grad, self.group, average=True, async_op=True, counter=self.counter))
        for handle in handles:
            if handle is not None:  # None: one rank, nothing was sent
                handle.wait()

    # -- what plan and the measurements ask (engines/planning.py, engines/measuring.py) ----------
    # Every rank holds every tensor whole: Plannable's defaults (planned_state, rank_states) hold.
    @classmethod
    def step_traffic(cls, model: ModelTraffic, options: Mapping[str, Any]) -> list[Collective]:
        """One all-reduce per trainable tensor per step."""
        calls = max(1, model.trainable_tensors)
        return [Collective("all_reduce", model.trainable_bytes / calls, calls, model.world)]

    def comm_counters(self) -> list[C.CommCounter]:
        return [self.counter]
