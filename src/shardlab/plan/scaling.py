"""Scaling a probe's measured peak, FLOPs and operations to the real model: its depth and its tokens per
micro batch.

[Note: scaling a probe's peak to the real depth]
A step's peak falls near the end of backward (or, with large activations, at its start).
At the end of backward every block but the last few holds what it keeps between steps
(shard, gradient, optimizer state, ddp's bucket) and the rest is transient: the units an
engine has gathered or is reducing, which its bounds cap (MAX_UNITS_REDUCING, prefetch),
so the transient does not grow with depth. Hence the step peak of L blocks is the deepest
probe's peak plus, per block added, what one block keeps between steps (the probes'
difference in step-end state, by part: exact, as per-block state is the same in every
block). Extrapolating each part of the peak linearly instead is off by whole units: which
parts a peak catches half-done moves between shallow probes (fsdp on gpt2-small, sharded
gradients at the peak: 13.5 MiB at 2 and 3 blocks, 27.0 at 4, 135.2 at 12).
That holds for the sharded engines (units, bounded). A replicated engine (ddp, torch-ddp,
single) has no units: every part of its peak is per-block state or per-block fresh
gradients (ddp keeps autograd's gradients beside its buckets until backward ends), so each
part is extrapolated linearly in depth.
The forward's peak is not always at its end, so its parts are not linear in depth: with
checkpointing a block keeps only its input, and a shallow probe's forward can peak where the
root unit is gathered (FSDP2's all-gather buffer beside the gathered parameters, activations
near 0) while a deeper one's peaks at its end. Mistral-7B on T4s (fp16, full checkpointing,
accumulation 2, torch-fsdp) did that between 3 and 4 blocks, and a line through the two
peaks' parts ran one moment's parts into the other's: comm -13.27 GiB beside activations
14.53 at 32 blocks. What a block adds is measured at one moment every probe has, the end of
the forward, where every block holds what it keeps for backward and its state; the forward
candidate is the deepest probe's forward peak plus that per block added. Where the forward
peaks at its end or in the head (after every block), that is exact; where it peaks earlier it
is high by at most one block's saved activations per block added.
A sharded engine's step peak comes at the start of backward when activations dominate: the
forward's activations plus the head's backward (the logits' gradient), not yet freed by any
block. The probes show it: their step peaks' activations grow between the two depths as the
forward's end's do (within 5 %): both caught the same moment, and each part is extrapolated
linearly, as for a replicated engine (the blocks' gradients, which the end-of-backward rule
adds per block, do not exist yet there).
Activations scale with tokens per micro batch in both.
All of this assumes every block adds the same to a rank. zero3 breaks it (its class says so:
`Plannable.probe_whole_depth`): owners get whole tensors, largest first, over the whole model,
so a cut model's owners are not the real one's (Mistral-7B at 16 ranks: rank 0 owns only the
embedding at 3 to 8 blocks, a 32nd of the model at 32), and neither are the reduce buffers in
flight at its peak, which are owners' groups under a cap in bytes (twice the largest unit's
parameters) that a few blocks do not reach. Rank 0's unsharded gradients at its peak, fake
probes of that model: 1194, 1610, 2058, 2080, 2080 MiB at 3 to 7 blocks, 2112 at 10, 2338 at
16, 2362 at 32; scaled from 3 and 4 blocks the whole peak came out 23 % low. plan probes such
an engine whole on fake tensors (seconds: 5.5 s for that model's 32-block step on this
machine), so nothing is scaled in depth; only a real-tensor probe of it is still cut.
"""

from __future__ import annotations

from shardlab.memory import PARTS
from shardlab.plan.ops import Census, extrapolate


def deepest_probe(per_layer: dict[str, dict]) -> dict:
    """The probe of the most blocks ("None": a model probed whole, without a block count)."""
    keys = [int(k) for k in per_layer if k != "None"]
    return per_layer[str(max(keys)) if keys else "None"]


def _extrapolation(per_layer: dict[str, dict], L: int | None) -> tuple[dict, dict, float] | None:
    """(deepest probe, shallowest probe, blocks): a value linear in depth is, at the real depth L,
    deepest + blocks x (deepest - shallowest). None where there is no depth to reach (L None, or no
    probe at a block count)."""
    keys = sorted(int(k) for k in per_layer if k != "None")
    if L is None or not keys:
        return None
    hi = per_layer[str(keys[-1])]
    lo = per_layer[str(keys[0])] if len(keys) > 1 else hi
    return hi, lo, ((L - keys[-1]) / (keys[-1] - keys[0]) if len(keys) > 1 else 0.0)


def scale_flops(per_layer: dict[str, dict], L: int | None) -> float:
    """FLOPs of one probe step at the real depth: a block's FLOPs are the same in every block, so
    the count is linear in depth (the two probe depths' difference per block), exact like the
    model state."""
    ext = _extrapolation(per_layer, L)
    if ext is None:
        return float(deepest_probe(per_layer)["step_flops"])
    hi, lo, blocks = ext
    return float(hi["step_flops"] + blocks * (hi["step_flops"] - lo["step_flops"]))


def scale_census(per_layer: dict[str, dict], L: int | None) -> Census:
    """The operations of one probe step at the real depth (plan/ops.py): linear in depth, as the FLOPs."""
    ext = _extrapolation(per_layer, L)
    if ext is None:
        return dict(deepest_probe(per_layer).get("census") or {})
    hi, lo, blocks = ext
    return extrapolate(hi.get("census") or {}, lo.get("census") or {}, blocks)


def scale_probe(per_layer: dict[str, dict], L: int | None, act_scale: float, sharded: bool) -> tuple[dict, dict]:
    """Parts at the real model's step peak and forward peak, from probes at two depths ([Note: scaling a
    probe's peak to the real depth], above)."""
    ext = _extrapolation(per_layer, L)
    if ext is None:
        v = deepest_probe(per_layer)
        step, fwd = dict(v["parts"]), dict(v["fwd_parts"])
    else:
        hi, lo, blocks = ext
        per_block = {p: hi["fwd_end_parts"].get(p, 0) - lo["fwd_end_parts"].get(p, 0) for p in PARTS}
        act_step = hi["parts"].get("activations", 0) - lo["parts"].get("activations", 0)
        act_fwd = per_block["activations"]
        at_backward_start = act_fwd > 0 and abs(act_step - act_fwd) <= 0.05 * act_fwd
        growth = "end_parts" if sharded and not at_backward_start else "parts"
        step = {p: hi["parts"].get(p, 0) + blocks * (hi[growth].get(p, 0) - lo[growth].get(p, 0)) for p in PARTS}
        fwd = {p: hi["fwd_parts"].get(p, 0) + blocks * per_block[p] for p in PARTS}
    # Only activations scale with tokens: of the step peak's "activations" (what was born in
    # forward or backward and nobody claimed), at most the forward's saved activations are; the
    # rest is backward-born storage of fixed size (PyTorch DDP's buckets on the one-rank probe).
    saved = min(step.get("activations", 0), fwd.get("activations", 0))
    step["activations"] = step.get("activations", 0) + (act_scale - 1) * saved
    fwd["activations"] = fwd.get("activations", 0) * act_scale
    return step, fwd
