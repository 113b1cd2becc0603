"""The hook machinery the engines that communicate from hooks (`ddp`, `zero3`, `fsdp`) share.

The engines run the model's own code unchanged and communicate from hooks: a forward
pre-hook gathers a unit, a forward hook frees it and hooks the outputs' gradients (the
pre-backward), gradient hooks reduce, and a callback at the end of backward waits for what is
still in flight. What differs is what a unit is made of (whole owned tensors vs flat slices);
the pieces below are the same and live here once, each beside the reasoning it follows: when
the hooks fire, forward hooks inside backward (activation checkpointing), when a unit holding
frozen parameters may be freed (`FrozenRelease`), why backward waits at its end
(`BackwardEnd`), the local accumulation inside `no_sync` (`NoSyncGrad`) and a reduced
gradient's way into `.grad` (`accumulate_grad_`, `ReducedGrads` with CPU offload).
Collectives, and the counting of what they move, are `engines/collectives.py`'s.

[Note: names in the engines]
What an engine built is public and read-only to everyone else: its layout (units, groups,
slots, owners, shards), its policies (offload, dtypes) and its counters. What changes while a
step runs (gathers alive, collectives in flight, the end-of-backward callback, gradients kept
under no_sync or on their way to the host) is private, read by no other module: the tools
get it through the contract (`Measurable.memory_buffers`, engines/measuring.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from shardlab.engines import collectives
from shardlab.engines.api import CPUOffload, materialize_whole_

# the state_dict's key mirror lives below every engine, minimal ones included; named here too
# for the full engines and engines/state_dict.py, which reach it as _hooks'
from shardlab.engines.state_keys import StateDictMirror as StateDictMirror
from shardlab.engines.state_keys import StateKey as StateKey


def weak_hook(method: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """A hook calling `method(*args, *hook_args)` that keeps neither the method's object nor
    `args` alive. Hooks on long-lived tensors (parameters, flat buffers) are held from C++,
    where the garbage collector cannot see the cycle they close (tensor -> hook -> engine ->
    tensor): with a strong hook the engine, its buffers and its last collectives' work would
    outlive the run, until interpreter finalization (see [Note: tearing down the process
    group] in runtime.py). Once any of them is gone the hook does nothing. Arguments that
    cannot be weakly referenced (ints) hold nothing and are kept as they are."""
    refs = [weakref.WeakMethod(method), *(_weak_or_plain(a) for a in args)]

    def hook(*hook_args: Any) -> Any:
        alive = [r() for r in refs]
        if any(x is None for x in alive):
            return None
        return alive[0](*alive[1:], *hook_args)

    return hook


def _weak_or_plain(value: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors start at the same element of one storage: `data_ptr` equality, asked
    in a way fake tensors (plan's probes: no data, no pointers) answer too."""
    return a.untyped_storage() is b.untyped_storage() and a.storage_offset() == b.storage_offset()


def tensors_requiring_grad(value: Any) -> list[torch.Tensor]:
    """The tensors inside any nesting of tuples, lists and dicts that require grad."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def cast_floating(value: Any, dtype: torch.dtype | None) -> Any:
    """`value` with every floating-point tensor inside it cast to `dtype` (mixed precision's
    input cast; None: unchanged)."""
    if dtype is None:
        return value
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


# [Note: when the hooks fire]
# - A forward pre-hook runs just before a unit's forward; a forward hook just after it.
# - A hook on a forward *output's* gradient runs when that gradient is complete, before any
#   backward node of the unit that produced it: the pre-backward, the moment to re-gather.
# - A post-accumulate-grad hook on a leaf runs once per backward, after autograd has summed
#   every use of that leaf (tied names, a unit called twice): the moment its gradient is
#   final and may be reduced.
# - Forward hooks also fire inside backward under some checkpoints ([Note: forward hooks
#   inside backward]); and a leaf's gradient tells nothing of the backward nodes that read only
#   frozen parameters ([Note: when a unit with frozen parameters may be freed]).


def hook_output_grads(output: Any, fn: Callable[[torch.Tensor], Any]) -> bool:
    """Register `fn(grad)` on every output tensor that requires grad: it fires when that
    output's gradient is complete, before any backward node of the unit that produced it
    runs (the pre-backward). Returns whether a backward can reach the unit at all."""
    outputs = tensors_requiring_grad(output)
    for t in outputs:
        t.register_hook(fn)
    return bool(outputs)


# [Note: forward hooks inside backward]
# shardlab checkpoints inside a unit's forward ([Note: hooks outside, checkpoint and compile
# inside], engines/compile.py): the recompute calls the unit's original forward, not the
# module, so the unit's own hooks do not fire again; it reads the parameters the pre-backward
# hook re-gathered. A checkpoint that calls a *module* again in backward (a unit nested in a
# checkpointed region, or `torch.distributed._composable.checkpoint`) makes that unit's forward
# hooks fire a second time, while an autograd graph task runs (`in_backward()`). By then the
# pre-backward hook has re-gathered the parameters, so the recompute must neither gather anew
# (fresh leaves, unrelated to the graph being backpropagated) nor free (backward still reads
# them); the recomputed graph itself is never backpropagated, so nothing is reduced twice. The
# recompute may also stop early, skipping the forward hook altogether: nothing may depend on
# the post hook running.


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread: a forward hook
    that fires then belongs to an activation-checkpointing recompute ([Note: forward hooks
    inside backward])."""
    return torch._C._current_graph_task_id() != -1


# [Note: when a unit with frozen parameters may be freed]
# A unit's gathered parameters may be freed in backward once no backward node reads them any
# more. Every node that read a trainable parameter has it as a differentiable input, so it runs
# before that parameter's gradient arrives: for a unit without frozen parameters, "all its
# gradients are in" is the moment. A frozen parameter gives no such signal, and the nodes that
# read it (a frozen LayerNorm computing its input's gradient) may well run after the unit's last
# trainable gradient: freeing then is the "setStorage: ... storage of size 0" crash. What does
# follow every node of a unit is the gradient of its inputs: so a unit holding frozen parameters
# also waits for a hook on the gradients of its inputs (all of them: register_multi_grad_hook,
# mode "all"), armed at each forward call. A unit whose inputs need no gradient (the first block
# after a frozen embedding; the root, which takes token ids) has no such signal and is freed at
# the end of backward, as a prefetched unit whose backward never came: one unit more held at the
# peak, nothing else. Reductions never wait for this: a gradient goes as soon as it is final.


def hook_input_grads(args: tuple, kwargs: dict, fn: Callable[[Any], Any]) -> bool:
    """Call `fn` once the gradients of *all* the unit's inputs that require grad are complete
    (register_multi_grad_hook, mode "all"). False if no input requires grad (no such signal)."""
    inputs = tensors_requiring_grad((args, kwargs))
    if inputs:
        torch.autograd.graph.register_multi_grad_hook(inputs, fn)
    return bool(inputs)


class FrozenRelease:
    """The rule of [Note: when a unit with frozen parameters may be freed], for one unit (fsdp) or
    one gather of a unit (zero3). The engine counts its own gradients and reports the input hooks:
    armed at each forward call (`arm`), fired in backward (`fired`)."""

    def __init__(self, frozen: bool):
        self.frozen = frozen   # holds frozen parameters: also waits for its inputs' gradients
        self.armed = 0         # input-gradient hooks armed (one per forward call with grad)
        self.due = 0           # ... of which not fired yet in this backward

    def arm(self, args: tuple, kwargs: dict, fn: Callable[[Any], Any]) -> None:
        """At a forward call with grad enabled: for a unit holding frozen parameters, `fn` once its
        inputs' gradients are complete (which must call `fired`)."""
        if self.frozen and hook_input_grads(args, kwargs, fn):
            self.armed += 1
            self.due += 1

    def fired(self) -> None:
        self.due = max(0, self.due - 1)

    def restart(self) -> None:
        """Another backward through the same graph (retain_graph=True): its hooks fire again."""
        self.due = self.armed

    def reset(self) -> None:
        self.armed = self.due = 0

    def may_free(self, grads_in: bool) -> bool:
        """Whether the unit may be freed, given whether all its trainable gradients are in."""
        return grads_in and (not self.frozen or (self.armed > 0 and self.due == 0))


# [Note: why we wait where we wait]
# Reductions launch asynchronously so they overlap the backward of earlier layers. The
# contract says communication is complete when `backward()` returns, so the optimizer step
# right after it sees final gradients: the first backward hook of a pass queues a callback on
# the autograd engine (`BackwardEnd`) that runs after the last node, still inside
# `loss.backward()`: the latest point that keeps the contract. It launches what could not
# launch (parameters unused in this step still take part, in the same order on every rank, so
# the collectives pair up), waits for everything in flight, and frees what is still gathered.
# Gathers are waited for right before their values are read.


class BackwardEnd:
    """Runs `callback` once after the last node of the current backward pass, still inside
    `loss.backward()` ([Note: why we wait where we wait]). Every backward hook calls `arm()`;
    only the first of a pass queues the callback."""

    def __init__(self, callback: Callable[[], None]):
        self._callback = callback
        self.queued = False

    def arm(self) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.queued = False
        self._callback()


@dataclass(eq=False)
class NoSyncGrad:
    """A gradient accumulated locally inside `no_sync()` (one per parameter or flat group): the
    sum of the unsynced backwards' gradients, reduced together with the next synced backward's.
    Whole (unsharded) and in the parameters' dtype, so accumulation trades memory for traffic."""

    kept: torch.Tensor | None = None

    def keep(self, grad: torch.Tensor, dtype: torch.dtype, *, copy: bool) -> None:
        """Inside no_sync: add `grad` to what is kept (the first one becomes it, in `dtype`;
        copy=False when the engine owns `grad` alone, as autograd handed it over)."""
        if self.kept is None:
            self.kept = grad.to(dtype, copy=copy)
        else:
            self.kept.add_(grad)

    def take(self, grad: torch.Tensor) -> torch.Tensor:
        """The first synced backward: what was kept plus `grad` (in place), and nothing kept after."""
        if self.kept is None:
            return grad
        total, self.kept = self.kept.add_(grad), None
        return total


@torch.no_grad()
def accumulate_grad_(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Add a reduced gradient into `param.grad`, which it becomes when there is none (cast to the
    parameter's dtype: no copy when it already has it)."""
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


class ReducedGrads:
    """A reduced gradient's way into its parameter's `.grad`: added at once; or, with CPU offload,
    copied asynchronously into a fresh (pinned) host tensor as soon as its reduction completes,
    and added only at the end of backward (`flush`), after synchronizing the stream (the host
    must not read a copy still in flight)."""

    def __init__(self, offload: CPUOffload | None, device: torch.device):
        self.offload, self.device = offload, device
        self._copies: list[tuple[nn.Parameter, torch.Tensor]] = []

    def add(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        if self.offload is None:
            accumulate_grad_(param, grad)
            return
        host = self.offload.host_tensor(grad)
        host.copy_(grad, non_blocking=host.is_pinned())  # device-to-host, asynchronous into pinned memory
        self._copies.append((param, host))

    def flush(self) -> None:
        if not self._copies:
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the D2H copies have landed
        for param, host in self._copies:
            accumulate_grad_(param, host)
        self._copies.clear()


@torch.no_grad()
def broadcast_from_rank0(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None,
                         counter: collectives.CommCounter | None) -> None:
    """Make every rank's copy equal to rank 0's (each tensor once, tied ones included)."""
    for t in {id(t): t for t in tensors}.values():
        collectives.broadcast(t.data, 0, group, counter=counter)


def replicate_from_rank0(module: nn.Module, device: torch.device, group: dist.ProcessGroup | None,
                         counter: collectives.CommCounter | None) -> None:
    """Give every rank the whole module with rank 0's values: a meta module is materialized (as a
    direct build would initialize it), then every parameter and buffer is broadcast from rank 0."""
    materialize_whole_(module, device)
    broadcast_from_rank0([*module.parameters(), *module.buffers()], group, counter)
