"""PyTorch's own engines behind shardlab's interface, for production use and comparison.

- torch-ddp: `torch.nn.parallel.DistributedDataParallel`, run from hooks on the user's module (which
  keeps its names: [Note: torch-ddp without DDP's wrapper]).
- torch-fsdp: FSDP2 `fully_shard` on each unit (transformer block, ResNet stage), then on
  the root, so parameters outside every unit (embeddings, tied head, final norm) are
  sharded with the root group. Tied parameters live in the root group, as FSDP2 requires.

Both count what they send in the same `CommCounter` form as the from-scratch engines, and enter
each collective in the hang doctor's flight record, through the extension points PyTorch offers:
engines/native_counting.py.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardlab.engines import collectives
from shardlab.engines.api import (
    CPUOffload,
    Engine,
    MixedPrecision,
    ShardPiece,
    accumulation_mode,
    is_meta,
    materialize_whole_,
)
from shardlab.engines.measuring import Measurable, MemoryTracking
from shardlab.engines.native_counting import counting_allreduce_hook, counting_fsdp2_comms
from shardlab.engines.planning import (
    Collective,
    LocalTensor,
    ModelTraffic,
    Plannable,
    bucketed_all_reduce,
    gathered_unit_traffic,
)
from shardlab.models.init import (
    INITIALIZER_ATTR,
    RANGE_READERS_ATTR,
    canonical_names,
    copy_full_value_,
    dtensor_local_rows,
    init_parameters_,
    materialize_,
    parameter_bindings,
    to_empty_keeping_ties_,
)


class TorchDDPEngine(Engine, Plannable, Measurable):
    options = ("bucket_size_bytes", "find_unused_parameters", "gradient_as_bucket_view")
    # On real tensors its hook's future needs a real group (plan probes it on a one-rank gloo group: a
    # replica's memory does not depend on N); on fake tensors it runs on the fake group, with the three
    # answers of plan/fake_ddp.py ([Note: PyTorch DDP on fake tensors]).
    fake_group_probe = False

    def __init__(self, module: nn.Module, *, bucket_size_bytes: int = 25 * 2**20,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = True, **kw: Any):
        super().__init__(module, **kw)
        # the user's module stays the returned one: [Note: torch-ddp without DDP's wrapper]
        self.module = materialize_whole_(module, self.device)
        self.ddp = nn.parallel.DistributedDataParallel(
            self.module,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            process_group=self.group,
            bucket_cap_mb=bucket_size_bytes / 2**20,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
        self.counter = collectives.CommCounter()
        self.ddp.register_comm_hook(None, counting_allreduce_hook(self.counter, self.group, self.world_size))
        _drive_from_hooks(self.ddp, self.module)

    def comm_counters(self) -> list[collectives.CommCounter]:
        return [self.counter]

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.ddp.no_sync()

    @classmethod
    def step_traffic(cls, model: ModelTraffic, options: Mapping[str, Any]) -> list[Collective]:
        return bucketed_all_reduce(model, options.get("bucket_size_bytes", 25 * 2**20))


# [Note: torch-ddp without DDP's wrapper]
# DistributedDataParallel wraps the module, so the wrapper's state_dict and named_parameters carry
# `module.`: a state dict saved under torch-ddp would not load under any other engine, and DCP's
# state-dict helpers strip the prefix only for a DDP instance they are handed. The user gets their
# own module instead, whose forward runs DDP's two halves from hooks, as DDP.forward runs them
# around the module's call: `_pre_forward` (the reducer's forward bookkeeping, buffer broadcast,
# inputs moved to the device) and `_post_forward` (the reducer prepared for backward). It is what
# PyTorch's composable `replicate` does; the reducer, its buckets and its hooks are DDP's, unchanged.
# `_active_ddp_module` tells torch.compile's DDPOptimizer that a compiled unit runs inside DDP.


def _drive_from_hooks(ddp: nn.parallel.DistributedDataParallel, module: nn.Module) -> None:
    """Run `ddp`'s forward halves around every call of `module` ([Note: torch-ddp without DDP's wrapper])."""
    cls = nn.parallel.DistributedDataParallel

    def pre(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cls._active_ddp_module = ddp
        return ddp._pre_forward(*args, **kwargs)

    def post(_m: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> Any:
        cls._active_ddp_module = None
        return ddp._post_forward(output)

    module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    module.register_forward_hook(post, with_kwargs=True)


class TorchFSDPEngine(Engine, Plannable, Measurable):
    """FSDP2. shard_size=S < N: hybrid sharding (HSDP) on a 2-D mesh ("replicate", "shard") of
    shape (N/S, S): parameters are DTensors placed (Replicate(), Shard(0)), sharded over the S
    consecutive ranks of a row, replicated down its columns; FSDP2 reduce-scatters gradients
    over the row and all-reduces them over the column. The rows and columns are the same
    process groups the from-scratch fsdp uses (`collectives.hybrid_groups`).
    offload=CPUOffload: FSDP2's CPUOffloadPolicy (sharded parameters, gradients and optimizer
    state on the host, pinned where CUDA exists).
    accumulate="sharded": gradient sync stays on inside no_sync, so FSDP2 reduce-scatters every
    micro batch and adds into the sharded gradient ([Note: sharded accumulation] in engines/api.py)."""

    grads_sharded = True
    options = ("reshard_after_forward", "mixed_precision", "shard_size", "offload", "accumulate")

    def __init__(self, module: nn.Module, *, reshard_after_forward: bool | int = True,
                 mixed_precision: Any = None, shard_size: int | None = None, offload: Any = None,
                 accumulate: str = "local", **kw: Any):
        super().__init__(module, **kw)
        self.accumulate = accumulation_mode(accumulate)
        # deferred here and below: torch.distributed.fsdp (and .tensor) cost 0.5 s to import; only
        # torch-fsdp needs them, and every engine class is imported to read its options
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        # A meta model is sharded first and given storage afterwards: see
        # [Note: torch-fsdp from the meta device] at _materialize_sharded_.
        meta = is_meta(module)
        if not meta:
            materialize_whole_(module, self.device)
        self.hybrid = collectives.hybrid_groups(self.group, shard_size)
        with unset_fake_temporarily():  # the mesh's rank tables are host metadata (plan's fake probes)
            mesh = self._device_mesh()
        mp = MixedPrecision.parse(mixed_precision)
        mp_policy = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype) if mp else MixedPrecisionPolicy()
        self.offload = CPUOffload.parse(offload)
        offload_policy = CPUOffloadPolicy(pin_memory=self.offload.pinned) if self.offload else OffloadPolicy()
        for unit in self.units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                        offload_policy=offload_policy)
        # The root's own parameters are needed again at once by backward: keep them gathered.
        fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload_policy)
        self.module = module
        self.counter = collectives.CommCounter()
        all_gather, reduce_scatter, all_reduce_hook = counting_fsdp2_comms(self.counter, self.hybrid.replicas,
                                                                            self.hybrid.replicate)
        for m in [*self.units, module]:
            m.set_custom_all_gather(all_gather)
            m.set_custom_reduce_scatter(reduce_scatter)
            if self.hybrid.replicas > 1:
                m.set_all_reduce_hook(all_reduce_hook)
        if meta:
            # shards live on the host with offload
            _materialize_sharded_(module, self.units, "cpu" if self.offload else self.device, self.device,
                                  getattr(module, "init_seed", 0))

    def _device_mesh(self) -> DeviceMesh:
        """FSDP2's mesh: (replicate, shard) for hybrid sharding, else the group's ranks."""
        if self.hybrid.replicas > 1:
            ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
            layout = torch.tensor(ranks).view(self.hybrid.replicas, self.hybrid.shard_size)
            self.grad_norm_group = self.hybrid.shard
            return DeviceMesh.from_group([self.hybrid.replicate, self.hybrid.shard], self.device.type, mesh=layout,
                                         mesh_dim_names=("replicate", "shard"))
        if self.group is None or self.group == dist.group.WORLD:
            return init_device_mesh(self.device.type, (self.world_size,))
        return DeviceMesh.from_group(self.group, self.device.type)

    def comm_counters(self) -> list[collectives.CommCounter]:
        return [self.counter]

    @contextlib.contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(self.accumulate == "sharded")
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in self.module.state_dict().items():
            if self.offload is not None and hasattr(v, "full_tensor"):
                v = v.to(self.device)  # host shards: the all-gather runs on the mesh's device
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k] = full.detach().to("cpu", copy=True)
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        from torch.distributed.tensor import distribute_tensor

        own = self.module.state_dict()
        for k, v in own.items():
            src = state[k].to(self.device)
            if hasattr(v, "device_mesh"):
                v.copy_(distribute_tensor(src, v.device_mesh, v.placements))
            else:
                v.copy_(src)

    def model_state_bytes(self) -> dict[str, int]:
        from torch.distributed.fsdp import FSDPModule

        # A forward without backward (evaluation) leaves groups with reshard_after_forward=False
        # unsharded; measure the state the engine keeps between steps.
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        params = self.local_parameters()
        loc = [p.to_local() for p in params]
        grads = [p.grad.to_local() for p in params if p.grad is not None]
        return {"params": sum(t.numel() * t.element_size() for t in loc),
                "grads": sum(t.numel() * t.element_size() for t in grads)}

    # -- Plannable (engines/planning.py), Measurable (engines/measuring.py) -----------------------
    @classmethod
    def planned_state(cls, params: list[nn.Parameter], world: int, options: Mapping[str, Any]
                      ) -> list[list[LocalTensor]] | None:
        """FSDP2's rule, as it cannot be built on meta: Shard(0) per parameter over the shard group
        (S ranks; S = N unless hybrid), every rank's storage padded to ceil(d0/S) rows."""
        group = options.get("shard_size") or world
        local = []
        for p in params:
            rows = p.shape[0] if p.dim() else 1
            per_rank = math.ceil(rows / group) * (p.numel() // rows if rows else 0)
            local.append(LocalTensor(per_rank, p.element_size(), p.requires_grad))
        return [local]

    @classmethod
    def step_traffic(cls, model: ModelTraffic, options: Mapping[str, Any]) -> list[Collective]:
        """As fsdp's: every unit all-gathered twice (the root kept), reduce-scattered once (sharded
        accumulation: per micro batch), in the shard group."""
        group = options.get("shard_size") or model.world
        return gathered_unit_traffic(model, "all_gather", "reduce_scatter", group, root_kept=True,
                                     accumulate=options.get("accumulate", "local"))

    def memory_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """FSDP2's per-parameter all-gather outputs (the unsharded parameters), their gradients,
        and the flat communication buffers of each parameter group. Private attributes of
        torch 2.13's `_fully_shard`, read with getattr: another version degrades to
        "activations" instead of failing (tests/test_memory.py checks they are found)."""
        for fp, pg in self._fsdp2_params():
            if fp is not None:
                for t in getattr(fp, "all_gather_outputs", ()):
                    yield "gathered_params", t
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None:
                    yield "gathered_params", unsharded
                    if unsharded.grad is not None:
                        yield "unsharded_grads", unsharded.grad
                continue
            result = getattr(pg, "_all_gather_result", None)
            if result is not None:
                yield "comm", result.all_gather_output
            partial = getattr(pg, "_partial_reduce_output", None)
            if partial is not None:
                yield "grads", partial
            ctx = getattr(pg, "comm_ctx", None)
            state = getattr(ctx, "all_gather_state", None)
            if state is not None:
                yield "comm", state.all_gather_result.all_gather_output
            for rs in getattr(ctx, "reduce_scatter_states", ()):
                yield "comm", rs.reduce_scatter_input

    def hook_memory_tracker(self, tracker: MemoryTracking) -> None:
        for fp, _pg in self._fsdp2_params():  # unsharded parameters exist from the first forward on
            unsharded = getattr(fp, "_unsharded_param", None) if fp is not None else None
            if unsharded is not None:
                tracker.hook_leaf(unsharded, "unsharded_grads")

    def _fsdp2_params(self) -> Iterator[tuple[Any, Any]]:
        """(FSDPParam, None) for every parameter, then (None, group) for every parameter group."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                pg = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
                if pg is not None:
                    for fp in pg.fsdp_params:
                        yield fp, None
                    yield None, pg

    def shard_layout(self) -> list[tuple[nn.Parameter, list[ShardPiece]]]:
        """FSDP2 parameters are DTensors: Shard(0) rows [r0, r1) of a tensor are the contiguous
        flat range [r0*row, r1*row) of the flattened tensor; Replicate is the whole tensor."""
        names = {id(p): n for n, p in self.unwrapped().named_parameters()}
        out = []
        for p in self.local_parameters():
            if not hasattr(p, "device_mesh"):
                out.append((p, [ShardPiece(names[id(p)], p.shape, 0, 0, p.numel())]))
                continue
            try:
                first_row, local_shape = dtensor_local_rows(p)
            except ValueError as e:
                raise ValueError(f"parameter {names[id(p)]!r}: {e}") from None
            numel = math.prod(local_shape)
            offset = first_row * math.prod(p.shape[1:])
            out.append((p, [ShardPiece(names[id(p)], p.shape, offset, 0, numel)] if numel else []))
        return out


@torch.no_grad()
def _materialize_sharded_(root: nn.Module, units: list[nn.Module], device: torch.device | str,
                          init_device: torch.device, seed: int) -> None:
    """Give a meta model already sharded by `fully_shard` storage on `device` (its DTensors'
    local shards only) and fill each rank's shards as a whole build would.

    [Note: torch-fsdp from the meta device]
    FSDP2 shards a meta model (DTensors placed Shard(0), and Replicate over HSDP's replica
    dimension), then `to_empty` allocates only each rank's local shard (unties shared
    parameters: they are retied at once, as `materialize_` does). How the shards are filled
    depends on the model:
    - A model that does not fill its own tensors (shardlab's): `init_parameters_` draws each
      tensor's full value from its name-keyed generator and `copy_full_value_` keeps the
      local rows (`materialize_`).
    - A model that fills its own tensors (`shardlab_initialize_`, models/hf.py): the parameters it
      reads by range (`shardlab_range_readers`: pretrained weights) are read straight into the
      local shard. A Shard(0) local shard is rows [first, first + rows) of the tensor
      (`dtensor_local_rows`), i.e. the flat range [first*row, (first + rows)*row): whole rows, so
      `read_flat_range` reads exactly the shard's elements, nothing more, and no rank ever reads
      or holds a whole tensor. Everything else (LoRA adapters, random init, and the buffers the
      model derives: rotary `inv_freq`, Gemma's `embed_scale`) goes through the model's own initializer, one FSDP
      unit at a time "on the side": the unit's parameters are swapped for stand-ins (a whole
      empty tensor for each that needs a value, a meta tensor, which the initializer leaves
      alone, for those already read), the initializer fills the unit as any engine's unit by unit
      materialization does, `copy_full_value_` copies the local rows of each whole stand-in into
      its DTensor, and the DTensors go back. (Running the initializer on the DTensors themselves
      would draw through DTensor's own sharded RNG: values unlike a whole build's.) The whole stand-ins live on the compute device, where
      a whole build draws its values (the model's `_init_weights` draws differ by device), so at
      most one unit's non-file parameters exist whole at a time: all of them for random init (as
      fsdp's unit by unit materialization), only the adapters for a LoRA load from files. A tied
      parameter is filled once, in the first unit that binds it, with every module binding it
      passed to the initializer (as fsdp does).
    """
    custom = hasattr(root, INITIALIZER_ATTR)
    if not custom:
        materialize_(root, device, seed)
        return
    to_empty_keeping_ties_(root, device)
    names = canonical_names(root)
    params = {id(p): p for p in root.parameters()}
    range_readers = getattr(root, RANGE_READERS_ATTR, None)
    readers = range_readers(list(params.values()), names) if range_readers is not None else {}
    for pid, read in readers.items():
        _read_local_rows_(params[pid], read)
    bindings = parameter_bindings(root)
    done_modules: set[int] = set()
    filled = set(readers)
    for unit in [*units, root]:
        region = [m for m in unit.modules() if id(m) not in done_modules]
        done_modules.update(id(m) for m in region)
        pending = [id(p) for m in region for p in m._parameters.values() if p is not None and id(p) not in filled]
        pending = list(dict.fromkeys(pending))
        has_buffers = any(b is not None for m in region for b in m._buffers.values())
        if not pending and not has_buffers:
            continue
        init_modules = list({id(m): m for m in [*region, *(m for pid in pending for m, _ in bindings[pid])]}.values())
        _fill_on_the_side_(root, init_modules, [params[pid] for pid in pending], names, init_device, seed)
        filled.update(pending)


def _fill_on_the_side_(root: nn.Module, init_modules: list[nn.Module], pending: list[nn.Parameter],
                       names: dict[int, str], init_device: torch.device, seed: int) -> None:
    """Run the model's own initializer over `init_modules` (one unit's region and every module
    binding its `pending` parameters) on whole stand-ins, then copy each pending parameter's
    local rows into its DTensor ([Note: torch-fsdp from the meta device]). A parameter not
    pending stands in as a meta tensor, which the initializer leaves alone."""
    wanted = {id(p) for p in pending}
    stand_ins: dict[int, nn.Parameter] = {}
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    side_names: dict[int, str] = {}
    for m in init_modules:
        for attr, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in stand_ins:
                where = init_device if id(p) in wanted else "meta"
                stand_ins[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=where),
                                                requires_grad=p.requires_grad)
                side_names[id(stand_ins[id(p)])] = names[id(p)]
            swapped.append((m, attr, p))
            m._parameters[attr] = stand_ins[id(p)]
    try:
        init_parameters_(root, seed, modules=init_modules, names=side_names)
    finally:
        for m, attr, p in swapped:
            m._parameters[attr] = p
    for p in pending:
        copy_full_value_(p, stand_ins[id(p)])


def _read_local_rows_(p: torch.Tensor, read: Any) -> None:
    """Fill a DTensor parameter's local shard from `read(start, end)` (elements [start, end) of the
    whole tensor flattened): its rows are one contiguous, whole-row range."""
    if not hasattr(p, "device_mesh"):
        p.copy_(read(0, p.numel()).view(p.shape).to(p.dtype))
        return
    first, shape = dtensor_local_rows(p)
    local = p.to_local()
    if not local.numel():
        return
    row = math.prod(p.shape[1:])
    rows = shape[0] if p.dim() else 1
    local.copy_(read(first * row, (first + rows) * row).view(shape).to(local.dtype))
