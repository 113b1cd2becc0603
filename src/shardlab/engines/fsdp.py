"""FSDP from scratch: every parameter, gradient and optimizer state is sliced across ranks.

The algorithm
-------------
The model is cut into *groups*: one per wrap unit (a transformer block, a ResNet stage)
and one for the root's remaining parameters (embeddings, tied head, final norm). A
group's parameters are laid end to end in one flat buffer, padded to a multiple of the
world size N; rank r keeps elements [r*S, (r+1)*S) (S = padded/N) as an ordinary
`nn.Parameter`, the *shard*. Shards are all `module.parameters()` yields, so any
`torch.optim` optimizer updates them and keeps its state 1/N-sized.

Around each group's forward and backward (hooks only; the model's code runs unchanged):

    pre-forward    all-gather the shards into the full buffer (wait for the prefetch if
                   one is in flight), point module.weight etc. at views of it, and start
                   the all-gather of the next unit (prefetch)
    post-forward   free the full buffer (reshard_after_forward=True) and hook the outputs
    pre-backward   (a hook on the outputs' gradients) all-gather again, prefetch the
                   unit backward reaches next
    post-backward  (the full buffer's grad-accumulation hook) reduce-scatter the full
                   gradient with averaging into a new shard-sized gradient, free the buffer
    end of backward  wait for every reduce-scatter, add the results into `shard.grad`

Who holds what, N ranks, units B0 B1 and the root R ('#' gathered, '~' all-gather in
flight, '.' only this rank's 1/N shard):

                     R   B0  B1
    forward B0       #   #   ~     B1 prefetched while B0 computes
    forward B1       #   .   #     B0 freed after its forward
    loss             #   .   .     the root stays gathered: backward needs it at once
    backward B1      #   ~   #     then reduce-scatter B1's gradient, free B1
    backward B0      #   #   .     then reduce-scatter B0's gradient, free B0
    backward R       #   .   .     then reduce-scatter R's gradient, free R
    optimizer step   .   .   .     shards and 1/N gradients only

Memory per rank with AdamW in fp32: 16 bytes per parameter / N (4 shard + 4 grad + 8
Adam moments), plus transiently the gathered parameters of the root and of the one or two
units in flight (the current one and a prefetched one), and each unit's full gradient
until its reduce-scatter completes. Under `no_sync`, each group additionally keeps its
whole unsharded fp32 gradient (4 bytes per parameter, not divided by N) until the next
synchronized backward: accumulation trades memory for communication. With mixed
precision the gathered copies are in param_dtype (2 bytes for bf16); shards, gradients
and optimizer state stay fp32.

Traffic per step, with Psi = parameter bytes: all-gather in forward (Psi), all-gather in
backward (Psi, minus the root group, which stays gathered as backward needs it at once),
reduce-scatter of gradients (Psi): about 3*Psi, each x (N-1)/N bus bytes on a ring.

[Note: why average]
Each rank's loss is the mean over its micro batch; the loss being trained is the mean
over the global batch, i.e. the mean of the N rank losses. Its gradient is the mean of
the N local gradients, so the reduce-scatter divides by N. Summing would multiply the
effective learning rate by N (the classic bug); the SGD parity test would catch it.

[Note: when each hook fires]
The full buffer is a leaf tensor `full` (requires_grad); the original parameters are
`full.split(sizes)` viewed to their shapes. Autograd therefore sums every use of every
parameter of the group (tied names, a unit called twice) into one SplitBackward node,
which concatenates them into one flat gradient (zeros for unused parameters and for the
padding) and hands it to `full`'s AccumulateGrad exactly once, after the group's last
gradient contribution. Its post-accumulate hook is our post-backward: no counting, and
it does not depend on the unit's inputs requiring grad. The pre-backward is a hook on
the gradient of each forward output; the first one to fire gathers, later ones find the
group gathered. With activation checkpointing the unit's forward runs again inside
backward; we recognise it (an autograd graph task is running), make sure the buffer is
gathered and do nothing else: the recomputed graph is never backpropagated, so nothing
is reduce-scattered twice.

[Note: why and where we wait]
Reduce-scatters are asynchronous so the next unit's backward overlaps them. The
optimizer must see final gradients, and the contract says communication is complete when
backward returns, so the first hook of each backward pass queues an autograd-engine
callback that runs after the last node: it waits for every reduce-scatter, accumulates
the results into `shard.grad`, and frees anything still gathered (e.g. a prefetched unit
whose backward never came). An async all-gather is waited on right before its buffer is
read (pre-forward, pre-backward) or freed.

[Note: freeing storage under autograd's feet]
Autograd saved views of `full` for backward (e.g. a Linear's weight). Freeing resizes the
underlying storage to zero bytes and regathering resizes it back and writes into it, so
those saved views see the regathered values. The writes go through `full.data`, which has
its own version counter, so autograd's in-place check is not tripped by the refill.

[Note: padding]
The padded tail of the flat buffer belongs to no parameter. SplitBackward fills it with
zeros, so after averaging its gradient is exactly zero, the optimizer (even with weight
decay) keeps it zero, and `clip_grad_norm_` is unaffected. Shards of equal size make
all-gather and reduce-scatter single calls; a rank may hold no piece of some parameters.

[Note: prefetch order]
Forward prefetch follows the unit order (`units` is forward order); backward prefetch
follows the reverse of the order in which units actually ran forward in this step. A
prefetch is only a head start: a prefetched group not used is freed at the end of the
forward (no grad) or of the backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from shardlab.engines import collectives
from shardlab.engines.api import Engine, MixedPrecision, ShardPiece, is_meta
from shardlab.models.init import canonical_names, init_parameters_


@dataclass
class FlatEntry:
    """One original parameter inside a group's flat buffer."""

    name: str                              # canonical name (first in named_parameters)
    shape: torch.Size
    offset: int                            # first element in the flat buffer
    numel: int
    bindings: list[tuple[nn.Module, str]]  # every (module, attribute) that refers to it


@dataclass
class FlatGroup:
    """A unit's (or the root's remaining) parameters as one sharded flat buffer."""

    module: nn.Module
    is_root: bool
    entries: list[FlatEntry]
    shard: nn.Parameter                    # this rank's slice, fp32, what the optimizer sees
    full: torch.Tensor                     # gathered buffer (leaf, compute dtype), storage freed when sharded
    full_data: torch.Tensor                # full.data: same storage, own version counter
    sizes: list[int]                       # split sizes: entries, then padding
    state: str = "sharded"                 # sharded | gathering | gathered
    handle: Any = None                     # in-flight all-gather
    send: torch.Tensor | None = None       # kept alive while the all-gather runs
    tracked_views: bool = False            # autograd-connected views installed for this step
    needs_backward: bool = False           # ran forward with grad; its post-backward is due
    unsharded_grad: torch.Tensor | None = None  # no_sync accumulation (full size, fp32)


class FSDPEngine(Engine):
    strategy = "fsdp"
    grads_sharded = True
    options = ("reshard_after_forward", "mixed_precision", "prefetch")

    def __init__(self, module: nn.Module, *, reshard_after_forward: bool = True, mixed_precision: Any = None,
                 prefetch: bool = True, **kw: Any):
        super().__init__(module, **kw)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.prefetch = bool(prefetch)
        mp = MixedPrecision.parse(mixed_precision) or MixedPrecision()
        self.param_dtype = mp.param_dtype or torch.float32
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype or torch.float32
        self.counter = collectives.CommCounter()
        self.sync_grads = True
        self.callback_queued = False
        self.pending_reduces: list[tuple[FlatGroup, torch.Tensor, torch.Tensor, Any]] = []
        self.forward_order: list[FlatGroup] = []
        self._build_groups(module)
        self._install_hooks()

    # -- construction ---------------------------------------------------------------------------
    def _build_groups(self, root: nn.Module) -> None:
        names = canonical_names(root)
        seed = getattr(root, "init_seed", 0)
        meta = is_meta(root)
        # The state_dict keys of the unwrapped model, to rebuild them in full_state_dict.
        # key -> canonical parameter name (str) or (module, buffer attribute).
        self._state_keys: list[tuple[str, Any]] = []
        for key, t in root.state_dict(keep_vars=True).items():
            if id(t) in names:
                self._state_keys.append((key, names[id(t)]))
            else:
                path, _, attr = key.rpartition(".")
                self._state_keys.append((key, (root.get_submodule(path), attr)))

        # Group tree: the root, then the units; each module belongs to the innermost unit.
        owners = [root, *self.units]
        unit_ids = {id(u) for u in self.units}
        group_of_module: dict[int, int] = {}
        parent: dict[int, int | None] = {0: None}
        for gi, owner in enumerate(owners):
            stack, seen = [owner], set()
            while stack:
                m = stack.pop()
                if id(m) in seen:
                    continue
                seen.add(id(m))
                if m is not owner and id(m) in unit_ids:
                    parent[owners.index(m)] = gi
                    continue
                group_of_module[id(m)] = gi
                stack.extend(m.children())

        def ancestry(gi: int) -> list[int]:
            path = [gi]
            while parent.get(path[-1]) is not None:
                path.append(parent[path[-1]])
            return path[::-1]

        # Parameters by id, with all their bindings; a tied parameter goes to the innermost
        # group that contains all of its bindings (so that group is gathered at every use).
        bindings: dict[int, list[tuple[nn.Module, str]]] = {}
        tensors: dict[int, nn.Parameter] = {}
        for m in root.modules():
            for attr, p in m._parameters.items():
                if p is not None:
                    bindings.setdefault(id(p), []).append((m, attr))
                    tensors[id(p)] = p
        members: list[list[int]] = [[] for _ in owners]
        order = {pid: i for i, pid in enumerate(names)}
        for pid in sorted(bindings, key=order.__getitem__):
            paths = [ancestry(group_of_module[id(m)]) for m, _ in bindings[pid]]
            common = 0
            for level in zip(*paths):
                if len(set(level)) > 1:
                    break
                common = level[0]
            members[common].append(pid)

        self.groups: list[FlatGroup] = []
        materialized: dict[int, str] = dict(names)
        for gi, owner in enumerate(owners):
            pids = members[gi]
            region = [m for m in owner.modules() if group_of_module.get(id(m)) == gi]
            if meta:
                # Materialize this group only: its parameters and its modules' buffers.
                for pid in pids:
                    p = tensors[pid]
                    new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                       p.requires_grad)
                    materialized[id(new)] = names[pid]
                    for m, attr in bindings[pid]:
                        m._parameters[attr] = new
                    tensors[pid] = new
                for m in region:
                    for bname, b in m._buffers.items():
                        if b is not None and b.device.type == "meta":
                            m._buffers[bname] = torch.empty_like(b, device=self.device)
                init_modules = region + [m for pid in pids for m, _ in bindings[pid]]
                init_parameters_(root, seed, modules=init_modules, names=materialized)
            else:
                for m in region:
                    for bname, b in m._buffers.items():
                        if b is not None:
                            m._buffers[bname] = b.to(self.device)
            if pids:
                params = [(names[pid], tensors.pop(pid), bindings[pid]) for pid in pids]
                self.groups.append(self._make_group(owner, gi == 0, params))
                del params  # the group's full tensors die here: one unit materialized at a time
        # Buffers stay whole on every rank; rank 0's values win (as in DDP).
        with torch.no_grad():
            for b in {id(b): b for b in root.buffers()}.values():
                collectives.broadcast(b, 0, self.group, counter=self.counter)
        self.root_group: FlatGroup | None = self.groups[0] if self.groups and self.groups[0].is_root else None
        self.unit_groups = [g for g in self.groups if not g.is_root]
        self.unit_index = {id(g): i for i, g in enumerate(self.unit_groups)}

    @torch.no_grad()
    def _make_group(self, owner: nn.Module, is_root: bool, params: list) -> FlatGroup:
        """Flatten `params` (name, full tensor, bindings), keep this rank's slice, drop the rest."""
        grads = {p.requires_grad for _, p, _ in params}
        if len(grads) > 1:
            raise NotImplementedError(f"{type(owner).__name__}: frozen and trainable parameters in one unit")
        entries, offset = [], 0
        for name, p, binds in params:
            entries.append(FlatEntry(name, p.shape, offset, p.numel(), binds))
            offset += p.numel()
        padded = -(-offset // self.world_size) * self.world_size
        shard_numel = padded // self.world_size
        lo = self.rank * shard_numel
        shard = torch.zeros(shard_numel, dtype=torch.float32, device=self.device)
        for e, (_, p, _) in zip(entries, params):
            a, b = max(lo, e.offset), min(lo + shard_numel, e.offset + e.numel)
            if a < b:
                shard[a - lo:b - lo].copy_(p.detach().reshape(-1)[a - e.offset:b - e.offset])
        for e in entries:  # the full tensors are freed here: no attribute refers to them now
            for m, attr in e.bindings:
                del m._parameters[attr]
        shard_param = nn.Parameter(shard, requires_grad=grads != {False})
        owner.register_parameter("flat_shard", shard_param)
        full = torch.empty(padded, dtype=self.param_dtype, device=self.device)
        full.requires_grad_(shard_param.requires_grad)
        full.untyped_storage().resize_(0)
        group = FlatGroup(owner, is_root, entries, shard_param, full, full.data,
                          [e.numel for e in entries] + [padded - offset])
        if full.requires_grad:
            full.register_post_accumulate_grad_hook(lambda _t, g=group: self._post_backward(g))
        for e in entries:  # outside forward/backward the original names are shape-only placeholders
            for m, attr in e.bindings:
                setattr(m, attr, torch.empty(e.shape, dtype=self.param_dtype, device="meta"))
        return group

    def _install_hooks(self) -> None:
        root = self.module
        root.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True)
        root.register_forward_hook(self._root_post_forward)
        for g in self.unit_groups:
            # prepend: gather before an activation-checkpointing pre-hook sees the unit run
            g.module.register_forward_pre_hook(lambda m, a, k, g=g: self._pre_forward(g, a, k),
                                               with_kwargs=True, prepend=True)
            g.module.register_forward_hook(lambda m, a, out, g=g: self._post_forward(g, out))

    # -- gather / free --------------------------------------------------------------------------
    def _start_gather(self, g: FlatGroup, async_op: bool) -> None:
        if g.state != "sharded":
            return
        g.full_data.untyped_storage().resize_(g.full_data.numel() * g.full_data.element_size())
        g.send = g.shard.detach().to(self.param_dtype)  # no copy in fp32: the shard itself is sent
        g.handle = collectives.all_gather_into(g.full_data, g.send, self.group, async_op=async_op,
                                               counter=self.counter)
        g.state = "gathering" if g.handle is not None and async_op else "gathered"

    def _wait_gather(self, g: FlatGroup) -> None:
        if g.state == "gathering":
            g.handle.wait()
            g.state = "gathered"
        g.handle = g.send = None

    def _gather(self, g: FlatGroup) -> None:
        self._start_gather(g, async_op=False)
        self._wait_gather(g)

    def _reshard(self, g: FlatGroup) -> None:
        if g.state == "sharded":
            return
        self._wait_gather(g)
        g.full_data.untyped_storage().resize_(0)
        g.state = "sharded"

    def _install_views(self, g: FlatGroup) -> None:
        """Point every binding at its view of the full buffer. With grad enabled the views
        are autograd-connected to `g.full`, so their gradients reach the post-backward hook."""
        pieces = torch.split(g.full, g.sizes)
        for e, piece in zip(g.entries, pieces):
            view = piece.view(e.shape)
            for m, attr in e.bindings:
                setattr(m, attr, view)

    def _use_views(self, g: FlatGroup) -> None:
        grad = torch.is_grad_enabled()
        if grad:
            g.needs_backward = True  # its backward reads these parameters (even frozen ones)
        if not g.tracked_views:  # a unit used twice keeps its first views: one gradient sum
            track = grad and g.full.requires_grad
            with torch.set_grad_enabled(track):
                self._install_views(g)
            g.tracked_views = track

    # -- forward hooks --------------------------------------------------------------------------
    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.param_dtype == torch.float32:
            return args, kwargs
        def cast(t: Any) -> Any:
            return t.to(self.param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        return tree_map(cast, args), tree_map(cast, kwargs)

    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if _in_backward():
            return None
        if not any(g.needs_backward for g in self.groups):
            self.forward_order.clear()  # the last forward's backward is done (or never comes)
        first_unit = self.unit_groups[0] if self.unit_groups else None
        if self.root_group is not None:
            self._gather_for_forward(self.root_group, first_unit)
        elif self.prefetch and first_unit is not None:
            self._start_gather(first_unit, async_op=True)
        return self._cast_inputs(args, kwargs)

    def _root_post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if _in_backward():
            return
        if not torch.is_grad_enabled():
            # No backward will follow: free everything, including unused prefetches.
            for g in self.groups:
                self._reshard(g)
            return
        if self.root_group is not None:
            self._hook_outputs(self.root_group, output)

    def _gather_for_forward(self, g: FlatGroup, prefetch: FlatGroup | None) -> None:
        self._start_gather(g, async_op=True)
        if self.prefetch and prefetch is not None:
            self._start_gather(prefetch, async_op=True)
        self._wait_gather(g)
        self._use_views(g)

    def _pre_forward(self, g: FlatGroup, args: tuple, kwargs: dict):
        if _in_backward():  # activation-checkpointing recompute: just make sure we are gathered
            self._gather(g)
            return None
        i = self.unit_index[id(g)]
        nxt = self.unit_groups[i + 1] if i + 1 < len(self.unit_groups) else None
        self._gather_for_forward(g, nxt)
        if torch.is_grad_enabled():
            self.forward_order.append(g)
        return self._cast_inputs(args, kwargs)

    def _post_forward(self, g: FlatGroup, output: Any) -> None:
        if _in_backward():
            return
        if not torch.is_grad_enabled():
            self._reshard(g)
            return
        if self.reshard_after_forward:
            self._reshard(g)
        self._hook_outputs(g, output)

    def _hook_outputs(self, g: FlatGroup, output: Any) -> None:
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda _grad, g=g: self._pre_backward(g))

    # -- backward hooks -------------------------------------------------------------------------
    def _arm_backward_end(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _pre_backward(self, g: FlatGroup) -> None:
        self._arm_backward_end()
        if not g.needs_backward:
            return
        if g.state == "sharded" and g.handle is None:
            self._start_gather(g, async_op=True)
        if self.prefetch and not g.is_root:
            order = self.forward_order
            i = len(order) - 1 - order[::-1].index(g) if g in order else -1
            for prev in reversed(order[:max(i, 0)]):
                if prev is not g and prev.needs_backward:
                    self._start_gather(prev, async_op=True)
                    break
        self._wait_gather(g)

    def _post_backward(self, g: FlatGroup) -> None:
        self._arm_backward_end()
        full_grad = g.full.grad
        g.full.grad = None
        g.needs_backward = False
        g.tracked_views = False
        self._reshard(g)
        if full_grad is None:
            return
        if not self.sync_grads:
            # [no_sync] keep the whole local gradient; reduce the sum on the next synced backward.
            if g.unsharded_grad is None:
                g.unsharded_grad = full_grad.float()  # ours alone: autograd handed it over
            else:
                g.unsharded_grad.add_(full_grad)
            return
        if g.unsharded_grad is not None:
            full_grad = g.unsharded_grad.add_(full_grad)
            g.unsharded_grad = None
        full_grad = full_grad.to(self.reduce_dtype)
        out = torch.empty(g.shard.numel(), dtype=self.reduce_dtype, device=self.device)
        handle = collectives.reduce_scatter_into(out, full_grad, self.group, average=True, async_op=True,
                                                 counter=self.counter)
        self.pending_reduces.append((g, out, full_grad, handle))

    @torch.no_grad()
    def _finish_backward(self) -> None:
        for g, out, _full, handle in self.pending_reduces:
            if handle is not None:
                handle.wait()
            if g.shard.grad is None:
                g.shard.grad = out if out.dtype == torch.float32 else out.to(torch.float32)
            else:
                g.shard.grad.add_(out)
        self.pending_reduces.clear()
        for g in self.groups:  # groups whose backward never came (unused outputs, stray prefetches)
            self._reshard(g)
            g.needs_backward = False
            g.tracked_views = False
            g.full.grad = None
        self.forward_order.clear()
        self.callback_queued = False

    # -- the contract ---------------------------------------------------------------------------
    @torch.no_grad()
    def _gather_fp32(self, g: FlatGroup) -> torch.Tensor:
        full = torch.empty(g.shard.numel() * self.world_size, dtype=torch.float32, device=self.device)
        collectives.all_gather_into(full, g.shard.detach(), self.group, counter=self.counter)
        return full

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        params: dict[str, torch.Tensor] = {}
        for g in self.groups:
            full = self._gather_fp32(g).cpu()
            for e in g.entries:
                params[e.name] = full[e.offset:e.offset + e.numel].view(e.shape).clone()
        out: dict[str, torch.Tensor] = {}
        for key, ref in self._state_keys:
            if isinstance(ref, tuple):
                m, attr = ref
                out[key] = m._buffers[attr].detach().to("cpu", copy=True)
            else:
                out[key] = params[ref]
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for g in self.groups:
            lo = self.rank * g.shard.numel()
            g.shard.zero_()
            for e in g.entries:
                flat = state[e.name].reshape(-1)
                a, b = max(lo, e.offset), min(lo + g.shard.numel(), e.offset + e.numel)
                if a < b:
                    g.shard[a - lo:b - lo].copy_(flat[a - e.offset:b - e.offset])
        for key, ref in self._state_keys:
            if isinstance(ref, tuple):
                m, attr = ref
                m._buffers[attr].copy_(state[key])

    def shard_layout(self) -> list[tuple[nn.Parameter, list[ShardPiece]]]:
        layout = []
        for g in self.groups:
            n = g.shard.numel()
            lo = self.rank * n
            pieces = []
            for e in g.entries:
                a, b = max(lo, e.offset), min(lo + n, e.offset + e.numel)
                if a < b:
                    pieces.append(ShardPiece(e.name, e.shape, a - e.offset, a - lo, b - a))
            layout.append((g.shard, pieces))
        return layout

    def comm_stats(self) -> dict[str, dict[str, int]]:
        return self.counter.snapshot()

    def gathered_bytes(self) -> int:
        """Bytes of gathered (full) parameter storage held right now, over all groups."""
        return sum(g.full_data.untyped_storage().nbytes() for g in self.groups)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (e.g. during an
    activation-checkpointing recompute)."""
    return torch._C._current_graph_task_id() != -1
