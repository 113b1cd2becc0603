"""shardlab: sharded data-parallel training on PyTorch.

    model = shardlab.parallelize(model, strategy="fsdp")   # any key of shardlab.STRATEGIES
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with shardlab.no_sync(model): loss.backward()            # accumulate without communicating
    norm = shardlab.clip_grad_norm_(model, 1.0)              # global norm, same on every rank
    full = shardlab.full_state_dict(model)                   # every rank calls it
    shardlab.load_full_state_dict(model, full)

[Note: a package that imports torch only when asked]
`import shardlab` runs before every `shardlab` command, `--help` and a config typo included, and
torch takes 1.5-2 s to import on a small machine. So this module imports neither torch nor the
engines: the names of the engines' API (`parallelize`, `STRATEGIES`, ...) are looked up in
`shardlab.engines` on first use (module `__getattr__`, PEP 562), and the functions below import
it when called. What the CLI answers before a run (`--help`, `shardlab configs`, most config
errors) stays free of torch: tests/test_cli_fast.py checks it in a fresh interpreter.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardlab.version import __version__  # a leaf (version.py): the layers below read it there

if TYPE_CHECKING:
    import contextlib

    import torch
    from torch import nn

    from shardlab.engines import STRATEGIES, MixedPrecision, engine_of, parallelize  # noqa: F401

__all__ = ["parallelize", "no_sync", "clip_grad_norm_", "full_state_dict", "load_full_state_dict",
           "engine_of", "MixedPrecision", "STRATEGIES", "fit", "register_model", "register_data", "FitResult",
           "__version__"]

# the public names that live in shardlab.engines, imported (with torch) on first use
_FROM_ENGINES = ("parallelize", "engine_of", "MixedPrecision", "STRATEGIES")
# the Python entry to shardlab's loop (entry.py, docs/python.md), imported on first use too
_FROM_ENTRY = ("fit", "register_model", "register_data", "FitResult")


def __getattr__(name: str) -> Any:
    if name in _FROM_ENGINES:
        return getattr(importlib.import_module("shardlab.engines"), name)
    if name in _FROM_ENTRY:
        return getattr(importlib.import_module("shardlab.entry"), name)
    raise AttributeError(f"module 'shardlab' has no attribute {name!r}")


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """Backward passes inside accumulate local gradients and communicate nothing."""
    from shardlab.engines import engine_of

    return engine_of(model).no_sync()


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip by the global gradient norm over all ranks; returns that norm (same on every rank)."""
    from shardlab.engines import engine_of

    return engine_of(model).clip_grad_norm_(max_norm, norm_type)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's state_dict (original names, full CPU tensors). Every rank must call it."""
    from shardlab.engines import engine_of

    return engine_of(model).full_state_dict()


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict; every rank must call it with the same values."""
    from shardlab.engines import engine_of

    engine_of(model).load_full_state_dict(state)


def _import_plugins() -> None:
    """SHARDLAB_PLUGINS=module[,module...]: modules imported with shardlab, which register their
    own engines (STRATEGIES), models (MODELS) or deploy targets (DEPLOY_TARGETS) in one line each.
    Every process a run starts inherits the variable (torchrun's workers, plan's probes, bench's
    cells), so the entries exist there too. A plugin registers before it imports shardlab.config,
    whose `model:` section is built from MODELS when it is first imported. Imported here, with
    the package, so no registry is ever read before its plugins registered."""
    for name in os.environ.get("SHARDLAB_PLUGINS", "").split(","):
        if name.strip():
            importlib.import_module(name.strip())


_import_plugins()
