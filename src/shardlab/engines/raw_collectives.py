"""torch.distributed's public collectives, entered in the hang doctor's flight record when code
outside shardlab calls them: a user's model that calls `torch.distributed.all_reduce` itself,
torch's checkpoint (DCP) exchanging its plans, FSDP2's HSDP all-reduce.

While the doctor is on (`install`, from doctor/worker.py; `uninstall` when it stops) each
function in COLLECTIVES is replaced, in the `torch.distributed` namespace, by a wrapper that
enters the call in the record before it is issued and marks it completed when it returns (an
async call: when its Work's `wait()` does). So a desync caused by a raw all-reduce in one rank's
forward is reported as that all-reduce, not as the collectives of ours that the other ranks
were in.

[Note: what the wrapper does not record]
- shardlab's own collectives: `engines/collectives.py` and the torch engines' counting hooks
  (`engines/native_counting.py`) enter their calls themselves, and reach torch.distributed through one
  to three frames of torch's own code (DDP's default hook, FSDP2's default all-gather). The
  wrapper looks at its callers, OWN_DEPTH frames up, and leaves a call alone when one of them
  is such a function. Recording it twice would put two entries where other ranks, on another
  engine path, have one.
- calls from threads other than the main one (DCP's asynchronous save): the record's writer
  takes no lock (flight.py, [Note: what a heartbeat costs]); one writer thread keeps it whole.
- groups of one rank: nothing can hang there (as in collectives.py).
- `from torch.distributed import all_reduce` done before the doctor started binds the original.
  torch's own modules call one another through `distributed_c10d`'s globals, which are not
  replaced, so an `all_gather_object` is one entry, not also the all-gathers inside it.
Sizes: the payload, as collectives.py counts it (the all-reduced tensor, the gathered output,
the reduce-scattered input); 0 where ranks may legitimately differ (all-to-all splits, pickled
objects) or nothing moves (barrier), so that the desync check compares like with like.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardlab.doctor.flight import RECORDER
from shardlab.engines.collectives import TimedWork

#: function name -> (the record's kind, which argument's bytes are the payload: None = 0)
COLLECTIVES: dict[str, tuple[str, str | None]] = {
    "all_reduce": ("all_reduce", "tensor"), "broadcast": ("broadcast", "tensor"), "reduce": ("reduce", "tensor"),
    "all_gather": ("all_gather", "tensor_list"), "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"), "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"), "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_to_all": ("all_to_all", None), "all_to_all_single": ("all_to_all", None), "barrier": ("barrier", None),
    "gather": ("gather", "tensor"), "scatter": ("scatter", "tensor"),
    "all_gather_object": ("all_gather_object", None), "broadcast_object_list": ("broadcast_object", None),
    "gather_object": ("gather_object", None), "scatter_object_list": ("scatter_object", None),
}
OWN_DEPTH = 4   # callers looked at: native_counting.py's hooks reach torch.distributed through up to 3 frames of torch
_OWN_MODULE = "shardlab.engines.collectives"
_OWN_HOOKS = ("shardlab.engines.native_counting", ("hook", "__call__"))   # the counting hooks' functions there
_originals: dict[str, Callable[..., Any]] = {}


def install() -> None:
    """Wrap every function of COLLECTIVES that this torch has (again: no effect)."""
    if _originals:
        return
    for name, (kind, payload) in COLLECTIVES.items():
        original = getattr(dist, name, None)
        if original is not None:
            _originals[name] = original
            setattr(dist, name, _recording(original, kind, payload))


def uninstall() -> None:
    for name, original in _originals.items():
        setattr(dist, name, original)
    _originals.clear()


def installed() -> bool:
    return bool(_originals)


def _recording(original: Callable[..., Any], kind: str, payload: str | None) -> Callable[..., Any]:
    params = list(inspect.signature(original).parameters)
    positions = {p: i for i, p in enumerate(params)}

    def arg(args: tuple, kwargs: dict, name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = positions.get(name, len(args))
        return args[i] if i < len(args) else None

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if RECORDER.mm is None or threading.current_thread() is not threading.main_thread() or _own_caller():
            return original(*args, **kwargs)
        group = arg(args, kwargs, "group")
        if not dist.is_initialized() or dist.get_world_size(group) <= 1:
            return original(*args, **kwargs)
        entry = RECORDER.issue(kind, _nbytes(arg(args, kwargs, payload)) if payload else 0, group)
        work = original(*args, **kwargs)
        if isinstance(work, dist.Work):
            # the flight entry completes when the first wait() returns (counter None: nothing counted)
            return TimedWork(work, None, kind, 0.0, entry)
        RECORDER.complete(entry)
        return work

    return wrapper


def _own_caller() -> bool:
    """Whether one of the wrapper's OWN_DEPTH callers is shardlab's own recording code."""
    frame = sys._getframe(2)   # 0: here, 1: the wrapper, 2: its caller
    for _ in range(OWN_DEPTH):
        if frame is None:
            return False
        module = frame.f_globals.get("__name__")
        if module == _OWN_MODULE or (module == _OWN_HOOKS[0] and frame.f_code.co_name in _OWN_HOOKS[1]):
            return True
        frame = frame.f_back
    return False


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0

