"""Float64 end to end: what `shardlab verify` runs its models under when it proves in float64.

[Note: float32 islands in a float64 run]
verify's proof moves the model to float64 so that an engine and one process can be told apart
down to rounding (u = 2^-53). A model can defeat that from inside: transformers' RMSNorm and
LayerNorm variants (Llama, Mistral, Qwen2, Granite, OLMo 2, Phi-3, ...) compute
`hidden_states.to(torch.float32)` whatever the model's dtype, eager attention takes its softmax
with `dtype=torch.float32`, and a few heads upcast their logits with `.float()`. Inside a
float64 model each of these is a *downcast*: a float32 island whose rounding (2^-24) is 10^9
times the float64 one, in the forward and, through the cast's backward, in every gradient that
flows back through it.

Why only some world sizes showed it: the engine run and the one-process reference compute the
same sums; they differ in how each rank's backward is scaled. Every rank weights its micro
batch's loss by N * n / G (its target count n of the global G, times N because the reduction
averages over N ranks: loss.py), so the gradient reaching a float32 island is N * n / G times
the reference's. Multiplying by 2 or 4 only moves the exponent, and float32 rounds the scaled
value exactly as it rounds the unscaled one; multiplying by 3 changes the significand, so the
island rounds differently (measured: dividing float32 gradients back after a loss scaled by 3
differs by 6.8e-8 relative; by 2 and 4, by 0). At 3 ranks (and 5, 6, 7, ...) the gradients then
differ by float32's unit roundoff, 6e-8, against a float64 tolerance near 1e-10: verify said NOT
EQUAL, and blamed averaging, for a model that trains exactly as one process would.

The fix lives where the cause does, and touches only verify: `Float64Everywhere` is a
`TorchFunctionMode` that verify enters around each of its runs (never `shardlab train`). While it
is on, a float64 tensor asked to become a lower-precision float (`.to(torch.float32)`,
`.float()`, `.half()`, `.bfloat16()`, `.type(torch.float32)`, `.type_as(float32 tensor)`, an op's `dtype=torch.float32`
with a float64 input) stays float64, so the model computes in float64 end to end and the proof is
a proof again. The rewrites are counted by the module that made them (`kept`) for verify's notes.

What the mode cannot rewrite (a kernel that returns float32 from float64 input by itself, an
in-place copy into a float32 buffer) is still seen: any op with a float64 input and a
lower-precision floating output is an island (`islands`), named by its module. verify then sets
its tolerance from that dtype and says so by name; it never reports such rounding as a fault.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

LOWER_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_SKIPPED_FILES = {__file__, torch.overrides.__file__}
_TO_LOWER = {torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
             torch.Tensor.bfloat16: torch.bfloat16}


def _is_float64(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float64


def _any_float64(args: tuple, kwargs: dict) -> bool:
    for a in (*args, *kwargs.values()):
        if _is_float64(a) or (isinstance(a, (list, tuple)) and any(_is_float64(b) for b in a)):
            return True
    return False


def _lower_output(out: Any) -> torch.dtype | None:
    t = out[0] if isinstance(out, (list, tuple)) and out else out
    return t.dtype if isinstance(t, torch.Tensor) and t.dtype in LOWER_FLOATS else None


def _type_target(args: tuple, kwargs: dict) -> Any:
    """The dtype `Tensor.type(dtype)` is asked for (None: a string type name, or none)."""
    target = args[1] if len(args) > 1 else kwargs.get("dtype")
    return target if isinstance(target, torch.dtype) else None


def _to_dtype_position(args: tuple, kwargs: dict) -> tuple[str, Any] | None:
    """Where `Tensor.to(...)`'s target dtype is given: ("kw", None), ("pos", i) or ("like", i)."""
    if isinstance(kwargs.get("dtype"), torch.dtype):
        return "kw", None
    for i, a in enumerate(args[1:3], start=1):
        if isinstance(a, torch.dtype):
            return "pos", i
        if isinstance(a, torch.Tensor):
            return "like", i
    return None


class Float64Everywhere(TorchFunctionMode):
    """See [Note: float32 islands in a float64 run]. `kept`: the downcasts kept in float64, by the
    module that asked for them; `islands`: ops that still turned float64 into a lower precision."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: Counter[str] = Counter()
        self.islands: Counter[str] = Counter()
        self.island_dtypes: set[torch.dtype] = set()
        self._sites: dict[tuple[Any, int], str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _TO_LOWER and _is_float64(args[0]):
            self._keep(f"{func.__name__}()")
            return args[0]
        if func is torch.Tensor.type_as and _is_float64(args[0]) and _lower_output(args[1]) is not None:
            self._keep("type_as()")
            return args[0]
        if func is torch.Tensor.type and _is_float64(args[0]) and _type_target(args, kwargs) in LOWER_FLOATS:
            self._keep(f"type({_type_target(args, kwargs)})")  # DeepSeek-V3's router: .type(torch.float32)
            return args[0]
        if func is torch.Tensor.to and _is_float64(args[0]):
            args, kwargs = self._keep_to(args, kwargs)
        elif kwargs.get("dtype") in LOWER_FLOATS and _any_float64(args, kwargs):
            self._keep(f"{getattr(func, '__name__', func)}(dtype={kwargs['dtype']})")
            kwargs["dtype"] = torch.float64
        out = func(*args, **kwargs)
        lowered = _lower_output(out)
        if lowered is not None and _any_float64(args, kwargs):
            self.islands[self._site(getattr(func, "__name__", str(func)))] += 1
            self.island_dtypes.add(lowered)
        return out

    def _keep_to(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        where = _to_dtype_position(args, kwargs)
        if where is None:
            return args, kwargs
        how, i = where
        target = kwargs["dtype"] if how == "kw" else args[i] if how == "pos" else args[i].dtype
        if target not in LOWER_FLOATS:
            return args, kwargs
        self._keep(f"to({target})")
        if how == "kw":
            return args, {**kwargs, "dtype": torch.float64}
        if how == "pos":
            return (*args[:i], torch.float64, *args[i + 1:]), kwargs
        return (args[0], args[i].device, torch.float64, *args[i + 1:]), kwargs  # .to(other): its device, float64

    def _keep(self, what: str) -> None:
        self.kept[self._site(what)] += 1

    def _site(self, what: str) -> str:
        """'LlamaRMSNorm: to(torch.float32)': the innermost module whose code made the call."""
        caller = sys._getframe(1)
        while caller.f_back is not None and caller.f_code.co_filename in _SKIPPED_FILES:
            caller = caller.f_back  # this file's frames and torch's dispatch (torch/overrides.py)
        key = (caller.f_code, caller.f_lineno)
        if key not in self._sites:
            frame, owner = caller, None
            while frame is not None and owner is None:
                candidate = frame.f_locals.get("self")
                owner = type(candidate).__name__ if isinstance(candidate, nn.Module) else None
                frame = frame.f_back
            self._sites[key] = f"{owner or caller.f_code.co_name}: {what}"
        return self._sites[key]

    def summary(self) -> dict[str, Any]:
        """What a run records (picklable)."""
        return {"kept": dict(self.kept), "islands": dict(self.islands),
                "island_dtypes": sorted(str(d).removeprefix("torch.") for d in self.island_dtypes)}


def merge_float64(per_rank: list[dict | None]) -> dict | None:
    """The ranks' Float64Everywhere records as one: counts summed by site, dtypes united."""
    if not any(per_rank):
        return None
    out: dict = {"kept": {}, "islands": {}, "island_dtypes": set()}
    for r in filter(None, per_rank):
        for key in ("kept", "islands"):
            for site, n in r[key].items():
                out[key][site] = out[key].get(site, 0) + n
        out["island_dtypes"] |= set(r["island_dtypes"])
    return out
