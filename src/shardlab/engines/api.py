"""The engine contract: what every strategy offers the training loop, and the small
frozen policies that configure it.

An engine takes a plain `nn.Module` (possibly on the meta device) and returns a module
whose `parameters()` are exactly what this rank holds and updates, so any `torch.optim`
optimizer works unchanged. The returned module carries its `Engine` (see `engine_of`);
the public functions in `shardlab` (`no_sync`, `clip_grad_norm_`, `full_state_dict`, ...)
dispatch to it. The training loop never asks which engine it drives.

Contract every engine keeps (the parity tests check it):
- forward: `module(*args)` computes what the unwrapped module computes;
- after `loss.backward()` returns, each local parameter's `.grad` holds the gradient of
  the *global mean* loss (gradients averaged over ranks, never summed) for the part this
  rank holds; all communication has completed;
- inside `no_sync()`, backward accumulates local gradients and communicates nothing; the
  first backward after leaving it reduces the accumulated gradients;
- `full_state_dict()` is called by every rank and returns the unwrapped module's
  `state_dict()` keys (original names, tied names included) with full CPU tensors.

The reasoning the engines that communicate from hooks (ddp, zero3, fsdp) share is written
beside the hooks, in `engines/_hooks.py`; the contract's own reason is here:

[Note: why average]
Each rank's loss is the mean over its own micro batch. With equal micro batches the loss
being trained, the mean over the global batch, is the mean of the N rank losses, so its
gradient is the mean of the N local gradients: every reduction divides by N. Summing
instead multiplies the effective learning rate by N (the classic bug of public
attempts); with Adam it also shifts the balance against epsilon. The parity tests train
with plain SGD, which turns an N-times gradient into a visibly different model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, Union

import torch
import torch.distributed as dist
from torch import nn

from shardlab.engines import collectives
from shardlab.engines.collectives import CommCounter, merged_seconds, merged_totals
from shardlab.models import outermost_modules, repeated_blocks
from shardlab.models.init import materialize_

ENGINE_ATTR = "_shardlab_engine"

WrapSpec = Union[None, set, frozenset, tuple, list, Callable[[nn.Module], bool]]


@dataclass(frozen=True)
class MixedPrecision:
    """param_dtype: dtype of the gathered parameters used for compute (None: the parameters' own).
    reduce_dtype: dtype gradients are communicated in (None: param_dtype, else the parameters' own).
    Sharded/local parameters and the optimizer state always stay in the parameters' own dtype
    (fp32 for a model built as usual, fp64 for the float64 parity tests)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    @classmethod
    def parse(cls, value: Any) -> MixedPrecision | None:
        """Accept None, a MixedPrecision, a dtype name ("bf16", "fp16", "fp32") or a dict."""
        if value is None or isinstance(value, MixedPrecision):
            return value
        if isinstance(value, str):
            dt = DTYPES[value]
            return None if dt == torch.float32 else cls(param_dtype=dt, reduce_dtype=dt)
        if isinstance(value, Mapping):
            return cls(**{k: DTYPES[v] if isinstance(v, str) else v for k, v in value.items()})
        raise TypeError(f"mixed_precision must be None, a dtype name or a dict, not {value!r}")

    @classmethod
    def from_names(cls, param: str, reduce: str | None) -> MixedPrecision | None:
        """The config's pair (parallel.mixed_precision, parallel.reduce_dtype): reduce None follows
        param; fp32 for both is no policy at all (the parameters' own dtype throughout)."""
        if reduce is None or reduce == param:
            return cls.parse(param)
        param_dtype = None if DTYPES[param] == torch.float32 else DTYPES[param]
        return cls(param_dtype=param_dtype, reduce_dtype=DTYPES[reduce])


@dataclass(frozen=True)
class CPUOffload:
    """Keep the sharded state in host memory: the shards (the optimizer's parameters), their
    gradients and so the optimizer state live on the CPU, pinned when CUDA exists (fast,
    asynchronous copies), and the optimizer step runs there. A unit's shards are copied to the
    device inside its gather; a reduced gradient is copied back to the host after the reduce.
    pin_memory: None = pin when CUDA is available (pinning needs a CUDA driver)."""

    pin_memory: bool | None = None

    @property
    def pinned(self) -> bool:
        return torch.cuda.is_available() if self.pin_memory is None else bool(self.pin_memory)

    @classmethod
    def parse(cls, value: Any) -> CPUOffload | None:
        """Accept None, "none", "cpu", a CPUOffload or a dict of its fields."""
        if value is None or isinstance(value, CPUOffload):
            return value
        if isinstance(value, str):
            if value in ("none", ""):
                return None
            if value == "cpu":
                return cls()
            raise ValueError(f"offload must be 'none' or 'cpu', not {value!r}")
        if isinstance(value, Mapping):
            return cls(**value)
        raise TypeError(f"offload must be None, 'none', 'cpu' or a CPUOffload, not {value!r}")

    def host_tensor(self, like: torch.Tensor, numel: int | None = None) -> torch.Tensor:
        """An uninitialized 1-D (numel) or like-shaped host tensor of `like`'s dtype, pinned per the policy."""
        shape = (numel,) if numel is not None else like.shape
        return torch.empty(shape, dtype=like.dtype, device="cpu", pin_memory=self.pinned)


DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64, "float64": torch.float64,  # the mixed-precision path computing in float64 (verify)
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def resolve_units(model: nn.Module, wrap: WrapSpec) -> list[nn.Module]:
    """The wrap units below the root, in module (forward) order.

    wrap=None: the model's repeated blocks (children of every nn.ModuleList, ResNet stages).
    A set/tuple/list of module classes: every module of those classes (outermost only).
    A callable: every module for which wrap(module) is true (outermost only).
    """
    if wrap is None:
        return repeated_blocks(model)
    if isinstance(wrap, (set, frozenset, tuple, list)):
        classes = tuple(wrap)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"wrap as a collection must hold nn.Module classes, got {wrap!r}")
        return outermost_modules(model, lambda m: isinstance(m, classes))
    if callable(wrap):
        return outermost_modules(model, wrap)
    raise TypeError(f"wrap must be None, a set of module classes or a predicate, not {type(wrap).__name__}")


class LocalTensor(NamedTuple):
    """One tensor a rank keeps between steps, as plan counts its model state: elements,
    bytes per element, and whether it trains (then it has a gradient and optimizer state)."""

    numel: int
    element_size: int
    trainable: bool


@dataclass(frozen=True)
class ModelTraffic:
    """What an engine's traffic per step depends on, measured on the (meta) model: parameter
    bytes in the dtype they are communicated in, and the wrap units."""

    param_bytes: float          # every parameter
    trainable_bytes: float      # those that get a gradient
    root_bytes: float           # those outside every wrap unit (the root's own)
    units: int                  # wrap units, the root not counted
    micro_batches: int          # forward/backward passes per rank per step
    world: int
    tensors: int                # parameter tensors (tied names counted once): per-tensor collectives' calls
    trainable_tensors: int      # those that get a gradient


class Collective(NamedTuple):
    """One kind of collective in a step: its full (unsharded) bytes per call, calls per step,
    and ranks in the group it runs over."""

    kind: str
    nbytes: float
    calls: int
    ranks: int


def bucketed_all_reduce(model: ModelTraffic, bucket_bytes: int) -> list[Collective]:
    """DDP's traffic: every trainable gradient all-reduced once per step, in buckets."""
    calls = max(1, math.ceil(model.trainable_bytes / bucket_bytes))
    return [Collective("all_reduce", model.trainable_bytes / calls, calls, model.world)]


def gathered_unit_traffic(model: ModelTraffic, gather: str, reduce: str, group: int, *,
                          root_kept: bool) -> list[Collective]:
    """A sharded engine's traffic: every unit (the root one of them) gathered for forward at
    every micro batch and again for backward (`root_kept`: the root stays gathered between the
    two, so it is not gathered again), and its gradients reduced once per step, all within a
    group of `group` ranks; with hybrid sharding (group < world) each unit's reduced 1/group
    slice is then all-reduced across the world/group replicas."""
    n = model.units + 1
    again = n - 1 if root_kept else n
    out = [Collective(gather, model.param_bytes / n, n * model.micro_batches, group),
           Collective(gather, (model.param_bytes - (model.root_bytes if root_kept else 0)) / max(1, again),
                      again * model.micro_batches, group),
           Collective(reduce, model.trainable_bytes / n, n, group)]
    if group < model.world:
        out.append(Collective("all_reduce", model.trainable_bytes / n / group, n, model.world // group))
    return out


class MemoryTracking(Protocol):
    """What the live-memory tracker (shardlab.memory.LiveMemoryTracker) offers an engine."""

    tracking: bool              # a step is being tracked now

    def hook_leaf(self, leaf: torch.Tensor, part: str) -> None:
        """Claim as `part` the gradient autograd accumulates into `leaf`, after the engine's hooks."""

    def hook_incoming(self, leaf: torch.Tensor, part: str) -> None:
        """Claim as `part` the gradient flowing into `leaf`, before AccumulateGrad and its hooks."""

    def keep_handle(self, handle: Any) -> None:
        """Remove `handle` (a hook the engine registered for the tracker) when the tracker closes."""


@dataclass(frozen=True)
class ShardPiece:
    """One contiguous piece of an original parameter inside a local (optimizer-visible) Parameter.

    Both offsets count elements of the *flattened* tensors: elements
    [local_start, local_start + numel) of the local Parameter hold elements
    [offset, offset + numel) of the full parameter `name` (of shape `full_shape`).
    The optimizer state of that local Parameter has the same layout, so a checkpoint can
    save and reshard parameters and optimizer state of any engine from this description.
    """

    name: str
    full_shape: torch.Size
    offset: int
    local_start: int
    numel: int


class Engine:
    """Per-model state of one strategy. The defaults suit replicated engines (every rank holds
    the whole module); sharded engines set `grads_sharded` and override `full_state_dict`,
    `load_full_state_dict`, `shard_layout` and, where storage is not plain, `model_state_bytes`.

    Besides training, an engine answers what the tools ask of it (plan, memory, bench, config;
    they hold no engine names): the class attributes below, `planned_state` (its exact state per
    rank), `step_traffic` (what it sends per step), `memory_buffers` and `hook_memory_tracker`
    (what it holds in flight, by part), `comm_counters` (what it counted)."""

    strategy: ClassVar[str]
    #: True when each rank's gradients are a disjoint part of the whole (sharded engines),
    #: False when every rank holds the whole gradient (replicated engines).
    grads_sharded: ClassVar[bool] = False
    #: option names this engine accepts, for a clear error on a misspelt one. The config keys
    #: `parallel.<name>` reach it through them (config.engine_options), and config refuses a
    #: key the strategy does not take (shard_size, offload) by asking them too.
    options: ClassVar[tuple[str, ...]] = ()
    #: False for an engine that runs in one process without torch.distributed (`single`): no
    #: process group is made for it and it runs at world size 1 only.
    distributed: ClassVar[bool] = True
    #: False when plan cannot probe the engine on real tensors on a fake process group, whose
    #: collectives return at once without peers (the future of PyTorch DDP's all-reduce hook needs a
    #: real one); plan's real-tensor probe then runs it on a real one-rank group, which is exact only
    #: when a rank's memory does not depend on N. Fake-tensor probes always run on the fake group.
    fake_group_probe: ClassVar[bool] = True
    #: False when plan cannot run the engine's step under FakeTensorMode (plan/probe.py, [Note:
    #: fake-tensor probes]); plan then probes it on real tensors at a reduced micro batch.
    fake_tensor_probe: ClassVar[bool] = True

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None, device: torch.device,
                 units: list[nn.Module]):
        self.group = group
        self.device = device
        self.units = units
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.module = module  # the module returned to the user; subclasses may replace it
        #: the group over which the ranks' gradients are disjoint parts of the whole: the group,
        #: except for hybrid sharding (HSDP), where replicas hold equal gradients and the norm
        #: must count each shard once (the shard group).
        self.grad_norm_group = group

    # -- the contract ---------------------------------------------------------------------------
    #: False inside `no_sync()`. Engines that do their own communication read it in backward:
    #: while it is False they accumulate local gradients and send nothing.
    sync_grads: bool = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local gradients and communicate nothing."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Default for replicated engines: the user's module holds every tensor whole.
        Sharded engines override it (every rank must call theirs: it gathers)."""
        return unwrapped_state_dict(self.unwrapped())

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.unwrapped().load_state_dict(state)

    def local_parameters(self) -> list[nn.Parameter]:
        """What this rank holds and its optimizer updates (deduplicated)."""
        return list({id(p): p for p in self.module.parameters()}.values())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so the global norm is at most max_norm; returns the global norm
        (before clipping), the same value on every rank."""
        grads = [p.grad for p in self.local_parameters() if p.grad is not None]
        total = global_grad_norm(grads, norm_type, self.grad_norm_group, self.device, sharded=self.grads_sharded)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:  # an offloaded engine's gradients are on the host, the norm on the device
            g.mul_(coef.to(g.device, g.dtype))
        return total

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters and gradients this rank holds now (tensors the engine keeps
        between steps; transient gathered buffers excluded)."""
        params = self.local_parameters()
        return {"params": sum(_nbytes(p) for p in params),
                "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None)}

    def shard_layout(self) -> list[tuple[nn.Parameter, list[ShardPiece]]]:
        """For each local Parameter, the pieces of original parameters it holds.
        Default (replicated engines): every local parameter is one whole original parameter.
        Sharded engines override this; every original parameter's pieces over all ranks
        cover it exactly once."""
        names = {id(p): n for n, p in self.unwrapped().named_parameters()}
        return [(p, [ShardPiece(names[id(p)], p.shape, 0, 0, p.numel())]) for p in self.local_parameters()]

    def unwrapped(self) -> nn.Module:
        """The user's module (for engines that wrap it in another module, the inner one)."""
        return getattr(self, "inner", self.module)

    def comm_counters(self) -> list[CommCounter]:
        """The counters this engine's collectives add to (engines/collectives.py); none: not counted."""
        return []

    def comm_stats(self) -> dict[str, dict[str, int]] | None:
        """Bytes per collective kind since wrap, when the engine counts them."""
        counters = self.comm_counters()
        return merged_totals(counters) if counters else None

    def comm_seconds(self) -> dict[str, float] | None:
        """Seconds per collective kind since wrap, when the engine times them (what is timed:
        engines/collectives.py's docstring)."""
        counters = self.comm_counters()
        return merged_seconds(counters) if counters else None

    # -- what the tools ask (plan, memory) ------------------------------------------------------
    @classmethod
    def planned_state(cls, params: list[nn.Parameter], world: int, options: Mapping[str, Any]
                      ) -> list[list[LocalTensor]] | None:
        """The tensors each rank keeps between steps (its local parameters), by the engine's rule,
        without building it: `params` are the model's unique parameters (on the meta device),
        `options` the engine's. One list per distinct rank (plan takes the largest). None when
        only building the engine tells: plan then builds it on the meta device on a fake
        process group of `world` ranks, at the ranks `planned_ranks(world)`, and asks
        `rank_states()`. Default (replicated): every rank holds every parameter whole."""
        return [[LocalTensor(p.numel(), p.element_size(), p.requires_grad) for p in params]]

    @classmethod
    def planned_ranks(cls, world: int) -> list[int]:
        """The ranks plan builds the engine at when `planned_state` says None (the largest state
        is taken over what they report)."""
        return [0]

    def rank_states(self) -> list[list[LocalTensor]]:
        """What a built engine knows of the ranks' local tensors: by default this rank's own."""
        return [[LocalTensor(p.numel(), p.element_size(), p.requires_grad) for p in self.local_parameters()]]

    @classmethod
    def step_traffic(cls, model: ModelTraffic, options: Mapping[str, Any]) -> list[Collective]:
        """The collectives one training step issues, by design (docs/engines.md), for the time
        model of `shardlab plan`. Default: none (one process)."""
        return []

    def memory_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(part, tensor) for the transient buffers this engine holds right now, by the part
        names of shardlab.memory ("gathered_params", "unsharded_grads", "comm", "grads"), for
        the live-memory tracker. Read-only. Local parameters, their `.grad` and optimizer state
        are not listed (the tracker reads them directly). Default: none."""
        return iter(())

    def hook_memory_tracker(self, tracker: MemoryTracking) -> None:
        """Let `tracker` claim the gradients autograd delivers to the leaves this engine makes
        (gathered parameters), the moment they arrive ([Note: a gradient is a gradient from
        birth], shardlab/memory.py). Called when the tracker starts and at every step's end
        (leaves made since); a leaf already hooked is skipped by the tracker. Default: none."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                local = v.to_local() if hasattr(v, "to_local") else v
                total += _nbytes(local)
    return total


def global_grad_norm(grads: Iterable[torch.Tensor], norm_type: float, group: dist.ProcessGroup | None,
                     device: torch.device, *, sharded: bool) -> torch.Tensor:
    """Norm over all ranks' gradients. sharded=False: every rank holds the whole gradient, so
    the local norm is the global one and nothing is communicated. (group=None means the
    default WORLD group, as everywhere in torch.distributed, never "no group".)

    Computed in fp32, or in fp64 when any gradient is fp64: a float64 model's norm (and so
    its clipping coefficient) must be as exact as torch.nn.utils.clip_grad_norm_'s, which
    works in the gradients' dtype."""
    norm_type = float(norm_type)
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    if norm_type == float("inf"):
        local = max((g.detach().abs().max().to(device, dtype) for g in grads if g.numel()), default=torch.tensor(0.0))
        local = torch.as_tensor(local, dtype=dtype, device=device)
        if sharded and dist.is_initialized():
            collectives.all_reduce(local, group=group, op=dist.ReduceOp.MAX)  # in the doctor's record
        return local
    local = torch.zeros((), dtype=dtype, device=device)
    for g in grads:
        if g.numel():
            local += (g.detach().to(dtype).norm(norm_type) ** norm_type).to(device)
    if sharded and dist.is_initialized():
        collectives.all_reduce(local, group=group)  # in the hang doctor's record, like every step collective
    return local ** (1.0 / norm_type)


def engine_of(module: nn.Module) -> Engine:
    engine = getattr(module, ENGINE_ATTR, None)
    if engine is None:
        raise TypeError("this module was not returned by shardlab.parallelize(); wrap it first")
    return engine


def attach(engine: Engine) -> nn.Module:
    object.__setattr__(engine.module, ENGINE_ATTR, engine)
    return engine.module


def is_meta(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in [*module.parameters(), *module.buffers()])


def materialize_whole_(module: nn.Module, device: torch.device) -> nn.Module:
    """For engines that keep the whole model: give a meta model real storage, initialized
    exactly as the same model built directly (see shardlab.models.init)."""
    if is_meta(module):
        materialize_(module, device, getattr(module, "init_seed", 0))
    device = torch.device(device)
    elsewhere = [t for t in [*module.parameters(), *module.buffers()]
                 if t.device.type != device.type or device.index not in (None, t.device.index)]
    # only when needed: `.to` swaps a FakeTensor parameter (plan's fake probes), which its mode forbids
    return module.to(device) if elsewhere else module


def unwrapped_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict with every tensor detached, cloned to CPU, tied names kept."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict(keep_vars=False).items()}


class LocalEngine(Engine):
    """`single`: one process (or each rank on its own, unsynchronized). The reference."""

    strategy = "single"
    distributed = False

    def __init__(self, module: nn.Module, **kw: Any):
        super().__init__(module, **kw)
        materialize_whole_(module, self.device)
        self.world_size = 1
