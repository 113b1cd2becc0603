"""The keys of a module's state_dict, recorded before an engine replaces its parameters
(`StateDictMirror`), so `full_state_dict` and `model.state_dict()` give the user's keys back on
every engine (engines/state_dict.py). It imports only torch: the full sharded engines (through
engines/_hooks.py) and their minimal twins use it alike, and a reader of a minimal engine
meets nothing of the full ones here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StateKey:
    """One key of the unwrapped module's state_dict: a parameter (`param`: the engine's own
    reference to it; `name`, `shape`, `dtype`: its canonical name, the one `shard_layout`
    pieces carry, and what it was) or a buffer (`module`, `attr`)."""

    key: str
    param: Hashable | None = None
    module: nn.Module | None = None
    attr: str = ""
    name: str = ""
    shape: torch.Size = torch.Size()
    dtype: torch.dtype | None = None


class StateDictMirror:
    """The unwrapped module's state_dict keys, in order (tied names included), recorded before
    the engine replaces its parameters, so `full_state_dict` returns exactly those keys.

    param_ref maps a parameter to the engine's reference for it (a canonical name, a slot)."""

    def __init__(self, root: nn.Module, param_ref: Callable[[nn.Parameter], Hashable]):
        canonical = {id(p): n for n, p in root.named_parameters()}  # tied names share one Parameter
        self.keys: list[StateKey] = []
        for key, t in root.state_dict(keep_vars=True).items():
            if id(t) in canonical:
                self.keys.append(StateKey(key, param=param_ref(t), name=canonical[id(t)], shape=t.shape, dtype=t.dtype))
                continue
            path, _, attr = key.rpartition(".")
            module = root.get_submodule(path)
            if module._buffers.get(attr) is not t:
                raise NotImplementedError(f"{key!r} is neither a parameter nor a buffer of its module: this model "
                                          f"customizes its state_dict, which the sharded engines cannot mirror")
            self.keys.append(StateKey(key, module=module, attr=attr))

    def full(self, params: Mapping[Hashable, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The full state dict: parameters from `params` (reference -> full CPU tensor), buffers
        copied to CPU from their modules."""
        return {k.key: params[k.param] if k.module is None
                else k.module._buffers[k.attr].detach().to("cpu", copy=True) for k in self.keys}

    def missing(self, state: Mapping[str, torch.Tensor]) -> list[str]:
        return [k.key for k in self.keys if k.key not in state]

    @torch.no_grad()
    def load_buffers(self, state: Mapping[str, torch.Tensor]) -> None:
        for k in self.keys:
            if k.module is not None:
                k.module._buffers[k.attr].copy_(state[k.key])
