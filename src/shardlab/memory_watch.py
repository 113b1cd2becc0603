"""How the live-memory tracker (shardlab/memory.py, `LiveMemoryTracker`) sees storages come,
grow, shrink and go, apart from what it makes of them.

[Note: what a tracker sees]
A `TorchDispatchMode` (`Watch`) hands every tensor an operator returns to the tracker
(`SeesStorages.see`), saying whether the operator makes new storages (`returns_fresh`: views,
in-place and out= operators do not). `UntypedStorage.resize_`, which the sharded engines use to
free and refill gathered buffers, does not dispatch: it is wrapped once, and every tracker alive
hears of each resize (`SeesStorages.resized`). A storage's death is heard through a weakref
callback on its `StorageRecord`, which the tracker sets.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class SeesStorages(Protocol):
    """What a tracker offers the watch: a tensor an operator returned, and a storage resized."""

    def see(self, t: torch.Tensor, fresh: bool = True) -> None:
        """A tensor an operator returned; `fresh`: its storage may be new."""

    def resized(self, st: torch.UntypedStorage) -> None:
        """`st.resize_` has just returned."""


def storage_of(t: Any) -> torch.UntypedStorage | None:
    """The storage behind a tensor (a DTensor's local shard), or None for what has none here."""
    if not isinstance(t, torch.Tensor):
        return None
    local = getattr(t, "_local_tensor", None)  # DTensor: the shard this rank holds
    if local is not None:
        t = local
    if t.is_meta or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage
        return None


class StorageRecord:
    """One live storage: its bytes now and the part they count in."""

    __slots__ = ("nbytes", "part", "ref", "__weakref__")

    def __init__(self, nbytes: int, part: str):
        self.nbytes = nbytes
        self.part = part
        self.ref: weakref.ref | None = None


class Watch(TorchDispatchMode):
    """Hands every tensor an operator returns to the tracker."""

    def __init__(self, tracker: SeesStorages):
        super().__init__()
        self.tracker = tracker
        self.fresh: dict[Any, bool] = {}   # operator -> its outputs are new storages
        try:  # deferred: torch.distributed.tensor costs 0.5 s to import, and only FSDP2 makes DTensors
            from torch.distributed.tensor import DTensor

            self.subclasses: tuple[type, ...] = (DTensor,)
        except ImportError:  # a torch build without distributed
            self.subclasses = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # DTensor (FSDP2's parameters) must first unwrap into its local tensors; those ops
        # come back through this mode, and the local storages are what occupy memory.
        if self.subclasses and any(issubclass(t, self.subclasses) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        fresh = self.fresh.get(func)
        if fresh is None:
            fresh = self.fresh[func] = returns_fresh(func)
        see = self.tracker.see
        if isinstance(out, torch.Tensor):
            see(out, fresh)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    see(t, fresh)
                elif isinstance(t, (tuple, list)):
                    for u in tree_flatten(t)[0]:
                        if isinstance(u, torch.Tensor):
                            see(u, fresh)
        return out


def returns_fresh(func: Any) -> bool:
    """Whether an operator's outputs are new storages. Views, in-place and out= operators
    return (parts of) their inputs, per their schema's alias annotations: such an output
    may show a storage made before tracking (a dataset's token tensor sliced by `__getitem__`),
    which did not just come to life and must not be counted from here."""
    schema = getattr(func, "_schema", None)
    return schema is None or all(r.alias_info is None for r in schema.returns)


# -- UntypedStorage.resize_ does not dispatch: wrap it --------------------------------------------------
_original_resize = torch.UntypedStorage.resize_
# Every tracker alive in this process hears of storage resizes (weakly held: a dropped tracker leaves).
_watchers: weakref.WeakSet[Any] = weakref.WeakSet()


def _tracked_resize(storage: torch.UntypedStorage, size: int):
    out = _original_resize(storage, size)
    for tracker in list(_watchers):
        tracker.resized(storage)
    return out


def watch_resizes(tracker: SeesStorages) -> None:
    """Tell `tracker` of every storage resize from now until `unwatch_resizes`."""
    # Installed once and left in place: with no tracker alive it only forwards the call.
    if torch.UntypedStorage.resize_ is not _tracked_resize:
        torch.UntypedStorage.resize_ = _tracked_resize  # type: ignore[method-assign]
    _watchers.add(tracker)


def unwatch_resizes(tracker: SeesStorages) -> None:
    _watchers.discard(tracker)
