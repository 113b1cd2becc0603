"""shardlab: sharded data-parallel training on PyTorch.

    model = shardlab.parallelize(model, strategy="fsdp")   # any key of shardlab.STRATEGIES
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with shardlab.no_sync(model): loss.backward()            # accumulate without communicating
    norm = shardlab.clip_grad_norm_(model, 1.0)              # global norm, same on every rank
    full = shardlab.full_state_dict(model)                   # every rank calls it
    shardlab.load_full_state_dict(model, full)
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Mapping

import torch
from torch import nn

from shardlab.engines import STRATEGIES, MixedPrecision, engine_of, parallelize

__version__ = "0.1.0"
__all__ = ["parallelize", "no_sync", "clip_grad_norm_", "full_state_dict", "load_full_state_dict",
           "engine_of", "MixedPrecision", "STRATEGIES", "__version__"]


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """Backward passes inside accumulate local gradients and communicate nothing."""
    return engine_of(model).no_sync()


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip by the global gradient norm over all ranks; returns that norm (same on every rank)."""
    return engine_of(model).clip_grad_norm_(max_norm, norm_type)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's state_dict (original names, full CPU tensors). Every rank must call it."""
    return engine_of(model).full_state_dict()


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict; every rank must call it with the same values."""
    engine_of(model).load_full_state_dict(state)


def _import_plugins() -> None:
    """SHARDLAB_PLUGINS=module[,module...]: modules imported with shardlab, which register their
    own engines (STRATEGIES), models (MODELS) or deploy targets (DEPLOY_TARGETS) in one line each.
    Every process a run starts inherits the variable (torchrun's workers, plan's probes, bench's
    cells), so the entries exist there too. A plugin registers before it imports shardlab.config,
    whose `model:` section is built from MODELS when it is first imported."""
    for name in os.environ.get("SHARDLAB_PLUGINS", "").split(","):
        if name.strip():
            importlib.import_module(name.strip())


_import_plugins()
