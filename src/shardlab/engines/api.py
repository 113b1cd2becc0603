"""The training contract (`Engine`: what the training loop calls of every strategy) and the
small frozen policies that configure it. What the contract promises, and the two protocols
every engine answers beside it (`Plannable`, `Measurable`), are documented in
docs/architecture.md, "The engine contract"; the parity tests check the promises.

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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import torch
import torch.distributed as dist
from torch import nn

from shardlab.engines import collectives
from shardlab.engines.measuring import Measurable
from shardlab.engines.planning import Plannable
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


# [Note: sharded accumulation]
# With k > 1 micro batches per step the loop runs the first k - 1 backward passes inside
# `no_sync()` (it only says which micro batch is the last). An engine with a gradient shard then
# chooses how a micro batch's gradient reaches it, its option `accumulate`:
# - "local" (the default): nothing is sent inside no_sync; each rank sums its whole unsharded
#   gradient (4 bytes per parameter in fp32, not divided by N) until the last micro batch, which
#   reduces the sum once: one reduction per step, 4Psi more held between micro batches.
# - "sharded": no_sync changes nothing; every micro batch's gradient is reduced (reduce-scattered,
#   or reduced to its owner) as at k = 1, averaged, and added into the shard's `.grad`
#   (`_hooks.accumulate_grad_`; FSDP2 adds into the sharded grad likewise): no unsharded gradient
#   outlives its micro batch's backward, at k times the gradient traffic.
# Both give the same gradient: each micro batch's loss already carries its share of the global
# batch ([Note: token-weighted loss] in loop/loss.py), the reductions average over the same N
# ranks, and the sum of k averages is the average of the k-sum. With a reduce dtype below the
# parameters' each micro batch is rounded to it once, then summed in the parameters' dtype
# (local sums first and rounds once). Engines without a shard (ddp, torch-ddp) have nothing to
# add into: config refuses "sharded" for them.
ACCUMULATE_MODES = ("local", "sharded")


def accumulation_mode(value: str) -> str:
    """An engine's `accumulate` option, checked ([Note: sharded accumulation])."""
    if value not in ACCUMULATE_MODES:
        raise ValueError(f"accumulate must be one of {', '.join(ACCUMULATE_MODES)}, not {value!r}")
    return value


DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64, "float64": torch.float64,  # the mixed-precision path computing in float64 (verify)
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def resolve_units(model: nn.Module, wrap: WrapSpec) -> list[nn.Module]:
    """The wrap units below the root, in module (forward) order.

    wrap=None: the model's repeated blocks (children of every nn.ModuleList, ResNet stages).
    A set/tuple/list of module classes, or of class names (parallel.wrap_classes): every module
    of those classes (outermost only); a name no module has is an error.
    A callable: every module for which wrap(module) is true (outermost only).
    """
    if wrap is None:
        return repeated_blocks(model)
    if isinstance(wrap, (set, frozenset, tuple, list)) and wrap and all(isinstance(c, str) for c in wrap):
        found = {type(m).__name__ for m in model.modules()}
        missing = sorted(set(wrap) - found)
        if missing:
            raise ValueError(f"wrap (parallel.wrap_classes): no module of class {missing} in the model; its classes "
                             f"include {sorted(found)[:12]}")
        return outermost_modules(model, lambda m: type(m).__name__ in wrap)
    if isinstance(wrap, (set, frozenset, tuple, list)):
        classes = tuple(wrap)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"wrap as a collection must hold nn.Module classes, got {wrap!r}")
        return outermost_modules(model, lambda m: isinstance(m, classes))
    if callable(wrap):
        return outermost_modules(model, wrap)
    raise TypeError(f"wrap must be None, a set of module classes or a predicate, not {type(wrap).__name__}")


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
    """What the training loop calls: the training contract (module docstring), for one model
    and one strategy. The defaults suit replicated engines (every rank holds the whole module);
    sharded engines set `grads_sharded` and override `full_state_dict`, `load_full_state_dict`
    and `shard_layout`. Every engine class also composes `Plannable` (engines/planning.py) and
    `Measurable` (engines/measuring.py): docs/architecture.md, "The engine contract".

    Built by `parallelize` only, which passes the registry's name for it (`strategy`)."""

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

    def __init__(self, module: nn.Module, *, strategy: str, group: dist.ProcessGroup | None,
                 device: torch.device, units: list[nn.Module]):
        self.strategy = strategy  # its key in STRATEGIES (checkpoints record it)
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
        #: False inside `no_sync()`. Engines that do their own communication read it in backward:
        #: while it is False they accumulate local gradients and send nothing.
        self.sync_grads = True
        #: how micro batches accumulate ([Note: sharded accumulation]): engines with a gradient
        #: shard take it as their option `accumulate`; the others always accumulate locally.
        self.accumulate = "local"

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local gradients and communicate nothing; under
        accumulate="sharded" they reduce into the shard as any backward does."""
        previous = self.sync_grads
        self.sync_grads = previous and self.accumulate == "sharded"
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

    def shard_layout(self) -> list[tuple[nn.Parameter, list[ShardPiece]]]:
        """For each local Parameter, the pieces of original parameters it holds.
        Default (replicated engines): every local parameter is one whole original parameter.
        Sharded engines override this; every original parameter's pieces over all ranks
        cover it exactly once."""
        names = {id(p): n for n, p in self.unwrapped().named_parameters()}
        return [(p, [ShardPiece(names[id(p)], p.shape, 0, 0, p.numel())]) for p in self.local_parameters()]

    def unwrapped(self) -> nn.Module:
        """The user's module: every built-in engine returns it as `module` itself; an engine that
        wraps it in another module overrides this to return the inner one."""
        return self.module


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


class LocalEngine(Engine, Plannable, Measurable):
    """`single`: one process (or each rank on its own, unsynchronized). The reference."""

    distributed = False

    def __init__(self, module: nn.Module, **kw: Any):
        super().__init__(module, **kw)
        materialize_whole_(module, self.device)
        self.world_size = 1
