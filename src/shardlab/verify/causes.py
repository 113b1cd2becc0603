"""The likely cause of verify's first difference, from where it appears and what the runs saw.

Each cause is recognised by its signature, not guessed from the config:
- a module's output differs while every module before it agrees: if it is a BatchNorm in
  training mode, its statistics per rank; if dropout is on (--keep-dropout), dropout; else
  the module depends on which samples share a micro batch, or on state per rank;
- every module output agrees but the loss differs: the loss is normalized or scaled per micro
  batch (the ranks' target counts say which);
- the loss agrees but a gradient differs: the ratio of the rank's gradient to the reference's
  says "summed, not averaged" (x N) or "averaged twice" (x 1/N); a rank whose copy of a
  replicated gradient differs from the others' is named; a frozen parameter with a gradient;
- gradients agree but the norm differs: the norm is not the global one;
- gradients and norm agree but a value differs: a frozen parameter that moved, or the step;
- only a buffer differs: BatchNorm's running statistics per rank, or the buffer's own update.
"""

from __future__ import annotations

import math

import torch

from shardlab.verify.float64 import merge_float64

BATCHNORM = ("BatchNorm statistics per rank: in training mode each rank normalizes with the mean and variance of "
             "its own micro batch, so the model trained differs from one process on the global batch (and the "
             "running statistics drift apart). Set model.sync_batchnorm=true: statistics over all ranks.")
DROPOUT = ("dropout (or other randomness) per rank: each rank draws its own masks, so the runs differ by design. "
           "verify turns dropout off in both runs unless --keep-dropout is given; with it, this is expected.")
MODULE = ("this module's output differs while every module before it agrees: it depends on which samples share "
          "its micro batch (statistics over the batch) or on state that differs per rank (randomness, buffers).")
LOSS_NORMALISED = ("a loss normalised per micro batch: each rank divides its summed loss by its own count of "
                   "targets, and the ranks' counts differ ({detail}), so the mean of the ranks' losses is not the "
                   "loss of the global batch. Divide the sum of per-token losses by the global batch's target "
                   "count instead.")
LOSS_SCALED = ("a loss scaled per micro batch: the loss is {ratio:.4g}x the reference's while every module output "
               "agrees, so it scales with the micro batch's rows (a sum over samples, not a mean, or a division by "
               "a count per rank).")
LOSS_OTHER = ("the loss differs while every module output of the first micro batch agrees: it is reduced "
              "differently (normalised or scaled per micro batch, or weighted per rank).")
NOT_AVERAGED = ("gradients not averaged: rank {rank}'s gradient is {ratio:.4g}x the reference's with {n} ranks: summed "
                "over the ranks instead of averaged (divide by the world size).")
AVERAGED_TWICE = ("gradients divided twice: rank {rank}'s gradient is {ratio:.4g}x the reference's with {n} ranks "
                  "(averaged over the ranks and divided by the world size again).")
REPLICA = ("rank {rank}'s copy of this gradient differs from the reference's ({ratio}) while the loss agrees: that "
           "rank reduced the gradients differently (a rank that skips averaging, or a missed reduction).")
FROZEN_GRAD = ("a frozen parameter got a gradient: requires_grad=False in the model, no gradient in the reference, "
               "a non-zero one in the engine.")
GRADIENT = ("the gradient differs while the loss agrees: the reduction over ranks or micro batches (no_sync, "
            "hooks) of this parameter.")
GRAD_NORM = ("the gradient norm differs while every gradient agrees: it is not the global norm (each rank's own "
             "shard, or replicas counted more than once).")
FROZEN_MOVED = ("a frozen parameter changed: {name} has requires_grad=False and stays put in the reference, but "
                "the engine's optimizer moved it (a frozen parameter handed a gradient, even a zero one, is moved "
                "by weight decay and momentum).")
OPTIMIZER = ("the value after the optimizer step differs while gradients and norm agree: clipping, the "
             "learning rate, or this parameter's optimizer state.")
BUFFER = "this buffer differs while parameters and gradients agree: its update differs per rank."
# A gradient equal to the reference's (1x) but for an error of float32's rounding or less is no
# reduction fault (those are off by a factor): some module rounds in lower precision.
ROUNDING_SIZED = 1e-5
ROUNDING = ("a rounding-sized difference ({error:.1e}, 1x the reference's gradient): no reduction fault looks like "
            "this (those are off by a factor). Some module computes in float32 or lower inside the float64 run "
            "in a way verify did not see; --dtype config compares at the config's precision.")


def module_of(name: str, types: dict[str, str]) -> str:
    """'stem.1.running_mean' -> 'stem.1 (BatchNorm2d)'; a module path -> itself with its type."""
    path = name if name in types else name.rsplit(".", 1)[0] if "." in name else ""
    return f"{path or '<root>'} ({types.get(path, '?')})"


def _close(x: float, target: float, rel: float = 1e-3) -> bool:
    return abs(x - target) <= rel * abs(target)


def _ratio(a: torch.Tensor, r: torch.Tensor) -> tuple[float, float]:
    """Least-squares c with a ~ c r, and the relative residual |a - c r| / |a|."""
    rr = (r * r).sum().item()
    if rr == 0:
        return math.nan, 1.0
    c = (a * r).sum().item() / rr
    resid = (a - c * r).norm().item() / max(a.norm().item(), 1e-300)
    return c, resid


def _uneven_targets(counts: list[list[list[int]]] | None) -> str | None:
    """'24 vs 31 targets in micro batch 0 of step 0' when ranks' micro batches hold different counts."""
    for s, per_rank in enumerate(counts or ()):
        for i in range(len(per_rank[0])):
            seen = [rank[i] for rank in per_rank]
            if len(set(seen)) > 1:
                return f"{' vs '.join(map(str, seen))} targets in micro batch {i} of step {s}, rank by rank"
    return None


def _gradient_cause(f, plan, ref, engine) -> str:
    from shardlab.verify.runs import full_gradients

    if f.name in ref.meta["frozen"]:
        return FROZEN_GRAD
    ref_step = ref.step(f.step)["state"]
    r = full_gradients(ref.pieces(f.step), {k: v.numel() for k, v in ref_step.items()}).get(f.name)
    pieces = engine.pieces(f.step)
    rank = f.rank if f.rank is not None else 0
    items = pieces[rank].get(f.name, [])
    if r is None or not items:
        return GRADIENT
    a = torch.cat([v.to(torch.float64) for _, v in items])
    ref_part = torch.cat([r[o:o + v.numel()] for o, v in items])
    c, resid = _ratio(a, ref_part)
    n = engine.world
    if resid < 1e-6 and n > 1 and _close(c, n):
        return NOT_AVERAGED.format(rank=rank, ratio=c, n=n)
    if resid < 1e-6 and n > 1 and _close(c, 1 / n):
        return AVERAGED_TWICE.format(rank=rank, ratio=c, n=n)
    if _close(c, 1.0, 1e-4) and f.error < ROUNDING_SIZED:
        return ROUNDING.format(error=f.error)
    if f.rank is not None and n > 1:
        how = f"{c:.4g}x" if resid < 1e-6 else "not a multiple of it"
        return REPLICA.format(rank=rank, ratio=how)
    return GRADIENT


def _loss_cause(f, plan, ref, engine) -> str:
    uneven = _uneven_targets(engine.meta.get("targets"))
    if uneven:
        return LOSS_NORMALISED.format(detail=uneven)
    ratio = engine.step(f.step)["loss"] / ref.step(f.step)["loss"]
    n = engine.world
    if n > 1 and (_close(ratio, n, 1e-6) or _close(ratio, 1 / n, 1e-6)):
        return LOSS_SCALED.format(ratio=ratio)
    return LOSS_OTHER


def diagnose(f, comparison, plan, ref, engine) -> tuple[str, str]:
    """(module path and type, likely cause) of the first difference `f`."""
    types = ref.meta["module_types"]
    dropout_on = plan.keep_dropout and any("Dropout" in t for t in types.values())
    if f.phase == "forward" and f.name != "loss":
        where = module_of(f.name, types)
        if f.name in ref.meta["batchnorm"]:
            return where, BATCHNORM
        return where, DROPOUT if dropout_on else MODULE
    if f.phase == "forward":
        return "the loss (the model's forward output)", DROPOUT if dropout_on else _loss_cause(f, plan, ref, engine)
    where = module_of(f.name, types)
    if f.phase == "backward":
        return where, _gradient_cause(f, plan, ref, engine)
    if f.phase == "clip":
        return "clip_grad_norm_ (the engine's)", GRAD_NORM
    if f.phase == "step":
        frozen = f.name in ref.meta["frozen"] or _unmoved(ref, f)
        return where, FROZEN_MOVED.format(name=f.name) if frozen else OPTIMIZER
    module = f.name.rsplit(".", 1)[0]
    return where, BATCHNORM if module in ref.meta["batchnorm"] else BUFFER


def _unmoved(ref, f) -> bool:
    before = ref.meta["initial"] if f.step == 0 else ref.step(f.step - 1)["state"]
    return torch.equal(before[f.name], ref.step(f.step)["state"][f.name])


def run_notes(plan, ref, engine) -> list[str]:
    notes = _float64_notes(ref, engine)
    if ref.dropout_disabled:
        shown = ", ".join(ref.dropout_disabled[:6]) + (", ..." if len(ref.dropout_disabled) > 6 else "")
        notes.append(f"dropout turned off in both runs ({len(ref.dropout_disabled)}: {shown}): each rank would "
                     "draw its own masks; --keep-dropout keeps it")
    if plan.keep_dropout and any("Dropout" in t for t in ref.meta["module_types"].values()):
        notes.append("--keep-dropout: masks are drawn per rank and per micro batch layout, so the runs are expected "
                     "to differ where dropout is active")
    return notes


def _sites(counts: dict[str, int], limit: int = 4) -> str:
    names = sorted(counts, key=lambda k: -counts[k])
    return ", ".join(names[:limit]) + (f", and {len(names) - limit} more" if len(names) > limit else "")


def _float64_notes(ref, engine) -> list[str]:
    """What Float64Everywhere did and saw (verify/float64.py): the downcasts it kept in float64, and
    the modules that still computed in a lower precision, by name, with what that did to the tolerance."""
    both = merge_float64([ref.float64, engine.float64]) or {"kept": {}, "islands": {}}
    kept, islands = both["kept"], both["islands"]
    notes = []
    if kept:
        notes.append(f"float32 casts kept in float64 ({_sites(kept)}): the model computes in float32 there even in a "
                     "float64 model; verify runs it in float64 end to end (docs/verify.md)")
    if islands:
        notes.append(f"module(s) computing in float32 inside a float64 run, which verify cannot change: "
                     f"{_sites(islands)}; the tolerance is that precision's, not float64's")
    return notes
