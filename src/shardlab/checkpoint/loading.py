"""What a resume reads and checks (the checkpoint manager's load side, checkpoint/manager.py):
whether a checkpoint fits this model and optimizer (`compatibility_error`), what each rank reads
of it (`plan_reads`: ranges into its local parameters and fresh optimizer state, whole tensors for
the rest), and the optimizer's param groups restored from it (`restore_param_groups`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardlab.checkpoint.planners import _flat_local, _model_buffers, _Piece, checkpoint_layout

log = logging.getLogger("shardlab.checkpoint")


@dataclass
class Reads:
    """What one rank reads: ranges of flattened tensors into its local parameters and fresh
    optimizer-state tensors (pieces), and whole tensors (plain: buffers, scalars, RNG)."""

    pieces: list[_Piece]
    plain: dict[str, torch.Tensor]
    optimizer_state: dict[nn.Parameter, dict[str, torch.Tensor]]
    has_optim: bool
    rng_keys: list[str]


def plan_reads(model: nn.Module, opt, manifest: dict[str, Any], md: Any, rank: int) -> Reads:
    """What `rank` reads of a checkpoint (`manifest`, DCP metadata `md`) into `model` and `opt`."""
    pieces: list[_Piece] = []
    plain: dict[str, torch.Tensor] = {}
    new_state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    om = manifest["optimizer"]
    has_optim = bool(opt is not None and om is not None and (om["tensor_keys"] or om["scalar_keys"]))
    first_name = next(iter(manifest["params"]))
    for p, ps in checkpoint_layout(model):
        flat = _flat_local(p)
        for pc in ps:
            pieces.append(_Piece(f"model/{pc.name}", pc.offset, math.prod(pc.full_shape),
                                 flat[pc.local_start:pc.local_start + pc.numel]))
        if not has_optim or not _had_optimizer_state(p, ps, om, md):
            continue
        st: dict[str, torch.Tensor] = {}
        for key in om["tensor_keys"]:
            st[key] = torch.zeros_like(p.detach())
            sflat = _flat_local(st[key])
            for pc in ps:
                pieces.append(_Piece(f"optim/{pc.name}/{key}", pc.offset, math.prod(pc.full_shape),
                                     sflat[pc.local_start:pc.local_start + pc.numel]))
        for key in om["scalar_keys"]:
            # a local parameter holding only padding has no name of its own: its scalars
            # (Adam's step) equal every other parameter's, take the first one's
            fqn = f"optim/{ps[0].name if ps else first_name}/{key}"
            smd = md[fqn]
            st[key] = torch.empty(smd.size, dtype=smd.properties.dtype)
            plain[fqn] = st[key]
        new_state[p] = st
    for name, b in _model_buffers(model).items():
        plain[f"model/{name}"] = b
    rng_keys = [k for k in md if k.startswith(f"rng/{rank}/")]
    for k in rng_keys:
        plain[k] = torch.empty(md[k].size, dtype=md[k].properties.dtype)
    return Reads(pieces, plain, new_state, has_optim, rng_keys)


def _had_optimizer_state(p: torch.Tensor, pieces: list, om: dict[str, Any], md: Any) -> bool:
    """Whether the checkpoint holds optimizer state for local parameter `p`.

    [Note: parameters without optimizer state]
    A save writes optimizer state only for parameters the optimizer has state for, i.e. those
    that got a gradient. Frozen parameters (LoRA's base weights, fsdp's frozen flat shards) never
    do, even when they sit in the optimizer's param groups, and a trainable one that no loss has
    reached yet has none either. Asking to read state for them would fail on the missing keys
    (or, for a piece-less padding shard, borrow another parameter's), so a frozen parameter gets
    none, and a trainable one gets it iff the checkpoint has its keys. The resumed optimizer
    then holds state for exactly the parameters the saving one did."""
    if not p.requires_grad:
        return False
    if not pieces:  # only padding here: its state, if any, is as its group's
        return True
    name = pieces[0].name
    return all(f"optim/{name}/{key}" in md for key in [*om["tensor_keys"], *om["scalar_keys"]])


def compatibility_error(path: str, manifest: dict[str, Any], shapes: dict[str, list[int]],
                        buffers: dict[str, torch.Tensor], opt) -> str | None:
    """Why the checkpoint at `path` cannot load into a model of these parameter `shapes` and
    `buffers` and this optimizer, in a line that says what to set; None when it can."""
    saved = manifest["params"]
    missing = sorted(set(shapes) - set(saved))
    unexpected = sorted(set(saved) - set(shapes))
    if missing or unexpected:
        return (f"checkpoint {path} does not fit this model: parameters missing from the checkpoint: "
                f"{missing[:5]}{'...' if len(missing) > 5 else ''}; parameters the model lacks: "
                f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''} (was it written for another model.* config?)")
    wrong = [f"{n}: checkpoint {saved[n]} vs model {s}" for n, s in shapes.items() if list(saved[n]) != list(s)]
    wrong += [f"{n}: checkpoint {manifest['buffers'].get(n)} vs model {list(b.shape)}" for n, b in buffers.items()
              if manifest["buffers"].get(n) != list(b.shape)]
    if wrong:
        return (f"checkpoint {path} does not fit this model: model shape mismatch: {'; '.join(wrong[:5])}"
                f"{' ...' if len(wrong) > 5 else ''}; use the model.* config it was trained with")
    om = manifest["optimizer"]
    if opt is not None and om is not None and om["class"] != type(opt).__name__:
        return (f"checkpoint {path} holds {om['class']} state but the optimizer is {type(opt).__name__}; "
                "set train.optimizer as when it was saved")
    if opt is not None and om is not None and len(om["param_groups"]) != len(opt.param_groups):
        return f"checkpoint {path} has {len(om['param_groups'])} optimizer param groups, the optimizer {len(opt.param_groups)}"
    return None


def restore_param_groups(opt, saved: list[dict[str, Any]], path: str) -> None:
    """The learning rate is state (the schedule moves it); the other hyperparameters come from
    the config, and a difference from the checkpoint's is reported, not silently overridden."""
    for g, s in zip(opt.param_groups, saved):
        for k, v in s.items():
            if k in ("lr", "initial_lr"):
                g[k] = v
            elif k in g and _norm(g[k]) != _norm(v):
                log.warning("resuming from %s: optimizer %s is %r now, %r in the checkpoint; using %r", path, k,
                            g[k], v, g[k])


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v
