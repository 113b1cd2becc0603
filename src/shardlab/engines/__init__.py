"""The engine switch: `parallelize(model, strategy, ...)` and the registry of strategies.

Each strategy lives in its own file; this module only maps names to classes (imported
lazily, so `single` needs nothing distributed).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardlab.engines.api import ENGINE_ATTR, Engine, MixedPrecision, attach, engine_of, resolve_units
from shardlab.engines.compile import Checkpointing, apply_to_units
from shardlab.engines.measuring import Measurable, optimizer_state_bytes
from shardlab.engines.planning import Plannable
from shardlab.engines.state_dict import STATE_DICT_VALUES, install_state_dict


@dataclass(frozen=True)
class EngineEntry:
    """One strategy: where its Engine class lives (imported on first use, so `single` needs
    nothing distributed) and, for shardlab's own engines, PyTorch's engine that does the same
    job (`shardlab bench` reports their speed ratio). What it shards and which options it
    takes the class itself declares (`grads_sharded`, `options`)."""

    target: str                  # "module:Class"
    torch_twin: str | None = None


# name -> entry. The order is the order help texts list them in. Adding an engine: its file,
# and one line here.
STRATEGIES: dict[str, EngineEntry] = {
    "single": EngineEntry("shardlab.engines.api:LocalEngine"),
    "ddp": EngineEntry("shardlab.engines.ddp:DDPEngine", torch_twin="torch-ddp"),
    "zero3": EngineEntry("shardlab.engines.zero3:Zero3Engine", torch_twin="torch-fsdp"),
    "fsdp": EngineEntry("shardlab.engines.fsdp:FSDPEngine", torch_twin="torch-fsdp"),
    # the same algorithms, each in one short file with nothing beyond them: to read first (docs/engines.md)
    "ddp-minimal": EngineEntry("shardlab.engines.ddp_minimal:MinimalDDPEngine", torch_twin="torch-ddp"),
    "zero3-minimal": EngineEntry("shardlab.engines.zero3_minimal:MinimalZero3Engine", torch_twin="torch-fsdp"),
    "fsdp-minimal": EngineEntry("shardlab.engines.fsdp_minimal:MinimalFSDPEngine", torch_twin="torch-fsdp"),
    "torch-ddp": EngineEntry("shardlab.engines.native:TorchDDPEngine"),
    "torch-fsdp": EngineEntry("shardlab.engines.native:TorchFSDPEngine"),
}

# What tools compare an engine with (`shardlab verify --against`): the one-process run, and
# the plain all-reducing engine every other replicates or shards.
ONE_PROCESS = "single"
ALL_REDUCE = "ddp"

__all__ = ["STRATEGIES", "ONE_PROCESS", "ALL_REDUCE", "EngineEntry", "Engine", "Plannable", "Measurable",
           "MixedPrecision", "parallelize", "engine_class", "engine_of", "is_sharded", "optimizer_state_bytes",
           "ENGINE_ATTR"]


def engine_class(strategy: str) -> type[Engine]:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    mod, name = STRATEGIES[strategy].target.split(":")
    cls = getattr(importlib.import_module(mod), name)
    if not all(isinstance(cls, type) and issubclass(cls, face) for face in (Engine, Plannable, Measurable)):
        raise TypeError(f"strategy {strategy!r}: {STRATEGIES[strategy].target} must be a class composing Engine, "
                        "Plannable and Measurable (engines/api.py, planning.py, measuring.py), e.g. "
                        "`class MyEngine(Engine, Plannable, Measurable)`")
    return cls


def is_sharded(strategy: str) -> bool:
    """Whether each rank holds a disjoint part of the parameters and gradients (16 Psi / N state)."""
    return engine_class(strategy).grads_sharded


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def parallelize(model: nn.Module, strategy: str = "fsdp", wrap: Any = None, *,
                group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                activation_checkpointing: bool | str = "none", ac_every: int = 1, compile: bool = False,
                compile_mode: str | None = None, state_dict: str = "sharded", **options: Any) -> nn.Module:
    """Wrap `model` with `strategy` and return the module to train.

    model: a plain nn.Module, possibly on the meta device (sharded engines then
        materialize only what this rank holds; the others materialize it whole).
    wrap: the units: None (the model's repeated blocks), a set of module classes or of their
        names, or a predicate on modules. The root is always a unit of its own.
    group: the process group (default: the world). Needs torch.distributed initialized,
        except for strategy="single".
    activation_checkpointing: "none", "full" (recompute each unit's activations in backward)
        or "selective" (keep every other Linear product and the attention outputs); True and
        False mean "full" and "none". ac_every=K: only units 0, K, 2K, ...
    compile: torch.compile each unit's forward (inductor; compile_mode: torch.compile's mode).
        Both leave the engine's hooks outside: engines/compile.py.
    state_dict: what the returned module's `state_dict()` gives on a sharded engine, always under
        the user's module's keys: "sharded" (DTensors, as FSDP2's) or "full" (full CPU tensors);
        engines/state_dict.py, [Note: what model.state_dict() holds].
    options: engine options, e.g. reshard_after_forward, mixed_precision, bucket_size_bytes, prefetch.
    """
    cls = engine_class(strategy)
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        raise TypeError(f"strategy {strategy!r} takes no option(s) {unknown}; "
                        f"its options are: {', '.join(cls.options) or 'none'}")
    if cls.distributed and not dist.is_initialized():
        raise RuntimeError(f"strategy {strategy!r} needs torch.distributed initialized "
                           "(torch.distributed.init_process_group, or run through `shardlab train`)")
    if hasattr(model, ENGINE_ATTR):
        raise ValueError("this model is already parallelized")
    if state_dict not in STATE_DICT_VALUES:
        raise ValueError(f"state_dict must be one of {', '.join(STATE_DICT_VALUES)}, not {state_dict!r}")
    device = torch.device(device) if device is not None else default_device()
    checkpointing = Checkpointing.parse(activation_checkpointing, ac_every)
    units = resolve_units(model, wrap)
    apply_to_units(units, checkpointing, compile, compile_mode)
    engine = cls(model, strategy=strategy, group=group, device=device, units=units, **options)
    install_state_dict(engine, state_dict)
    return attach(engine)
