"""Mixtures of experts in a Hugging Face model: the router's auxiliary (load-balancing) loss as
transformers defines it, and expert kernels that run in float64.

[Note: the router loss across micro batches and ranks]
With `output_router_logits: true` in the model's config.json, transformers' `.loss` is the
cross-entropy plus `router_aux_loss_coef x load_balancing_loss_func(router_logits, num_experts,
top_k)`: for the tokens of the batch it is given, E x sum over experts e of f_e x P_e, where f_e is
the share of top-k assignments that went to e and P_e the mean router probability of e. Both are
means over that batch's tokens (all of them: with no attention mask, padding too), so the loss is
not a sum over tokens and depends on how a batch is cut: two halves' losses do not average to the
whole's.

shardlab adds the family's own function, on the family's own router logits (the decoder's
`router_logits`, asked for with `output_router_logits=True`), to the loss of every micro batch,
in both loss paths (full and chunked): a micro batch's loss equals transformers' `.loss` on the
same rows. The loop weights each micro batch by its share of the global batch's targets
([Note: token-weighted loss] in loop/loss.py), so the router term of a step is

    coef x sum over micro batches i (every rank) of (n_i / G) x balance(micro batch i)

the target-weighted mean of the micro batches' balancing losses (n_i: targets of micro batch i,
G: of the global batch). It equals transformers on the whole global batch when the global batch is
one micro batch, and it does not depend on the world size for a given micro batch size: N ranks of
k micro batches and one process of N x k micro batches of the same rows give the same step.

`router_groups` is how `shardlab verify` holds the engine to that definition: its one-process
reference takes the N ranks' micro batches i together as its micro batch i, so it computes the
balancing loss of each rank's rows apart (`router_groups = N`: the micro batch's rows cut into N
equal groups in order, each group's loss weighted by its share of the micro batch's targets). That
is the same sum, so verify compares like with like and never reports the definition as a fault.

[Note: router statistics]
metrics.json's `router` section says what the routers did over the steps this run trained: per MoE
layer, how many (token position, expert) assignments each expert received, summed over the micro
batches of every rank (token positions x top_k in all: padding included, as the router sees it),
and the mean of the balancing loss over the micro batches of every rank that computed it (with
`output_router_logits`; the loss took `aux_loss_coef` times it). The counts come from the routers'
own choices (their top-k indices, which transformers' routers return beside their logits, caught
by a forward hook), added after each training forward on the device: no synchronisation and no
extra forward; a recomputation in the backward (activation checkpointing) only overwrites what the
hook kept, which the next forward forgets. Evaluation forwards are not counted. Every rank's
figures are gathered once, at the end (loop/router_stats.py).

[Note: float64 experts]
transformers' default expert code (`experts_implementation="grouped_mm"`) calls
`torch._grouped_mm`, which has no float64 kernel on CPU. A model in float64 (model.hf_dtype=fp64,
and verify's proof) therefore uses transformers' "eager" experts, a loop over the experts that is
the same maths in plain matmuls (`float64_experts_`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardlab.models.lm_loss import IGNORE_INDEX

FLOAT64_EXPERTS = "eager"


def router_loss(causal_lm: nn.Module) -> tuple[Callable | None, str | None]:
    """(the family's balancing-loss function, None) when the config asks for the router loss;
    (None, None) when it does not; (None, why) when it asks and the family has none shardlab can call."""
    config = causal_lm.config
    if not getattr(config, "output_router_logits", False):
        return None, None
    fn = getattr(sys.modules.get(type(causal_lm).__module__), "load_balancing_loss_func", None)
    missing = [a for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef") if not hasattr(causal_lm, a)]
    if fn is None or missing:
        return None, (f"output_router_logits=true in the model's config: {type(causal_lm).__name__} has no "
                      f"load_balancing_loss_func{' or ' + ', '.join(missing) if missing else ''} in transformers "
                      "that shardlab could add to the loss; set output_router_logits=false in config.json")
    return fn, None


def router_balance(causal_lm: nn.Module, fn: Callable, router_logits: Any, targets: torch.Tensor,
                   groups: int = 1) -> torch.Tensor:
    """The balancing loss of the rows, which the loss takes `router_aux_loss_coef` times (see [Note:
    the router loss across micro batches and ranks]); groups > 1: the rows cut into that many equal
    groups, each weighted by its targets."""
    E, k = causal_lm.num_experts, causal_lm.num_experts_per_tok
    logits = tuple(router_logits)
    rows = targets.shape[0]
    if groups <= 1 or rows % groups:
        return fn(logits, E, k, None)
    per = rows // groups
    counts = (targets != IGNORE_INDEX).reshape(groups, -1).sum(dim=1).tolist()  # host ints: a float64 share
    total = sum(counts)
    out = 0.0
    for g in range(groups):
        part = tuple(t.reshape(rows, -1, t.shape[-1])[g * per:(g + 1) * per].reshape(-1, t.shape[-1]) for t in logits)
        out = out + fn(part, E, k, None) * counts[g] / total
    return out


# -- what the routers did: metrics.json's `router` section -----------------------------------------
class RouterStats:
    """Tokens per expert of every MoE layer and the balancing loss, over this process's training
    forwards ([Note: router statistics]). Made only for a model whose routers transformers records
    (`_can_record_outputs["router_logits"]`: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...)."""

    def __init__(self, routers: list[tuple[str, nn.Module]]):
        self.layers = [name for name, _ in routers]
        self.experts = int(routers[0][1].weight.shape[0])  # the router's weight: [experts, hidden]
        self.top_k: int | None = None
        self.counts: torch.Tensor | None = None  # [layers, experts], where the routers run
        self.balance_sum: torch.Tensor | None = None
        self.balance_n = 0
        self._seen: dict[int, torch.Tensor] = {}
        for i, (_, m) in enumerate(routers):
            m.register_forward_hook(functools.partial(self._keep, i))

    def _keep(self, layer: int, module: nn.Module, args: Any, output: Any) -> None:
        chosen = [o for o in output if torch.is_tensor(o) and not o.is_floating_point()]  # (logits, scores, indices)
        if chosen:
            self._seen[layer] = chosen[0]

    def begin(self) -> None:
        """Before a forward: forget the choices an earlier forward (or a recomputation) left."""
        self._seen.clear()

    def count(self) -> None:
        """After a training forward: add the experts each token position was sent to (on the device:
        no synchronisation)."""
        for layer, chosen in self._seen.items():
            if self.counts is None:
                self.counts = torch.zeros(len(self.layers), self.experts, dtype=torch.int64, device=chosen.device)
            self.top_k = chosen.shape[-1]
            flat = chosen.reshape(-1).long()  # scatter_add_, not bincount: a shape known ahead (fake tensors: plan)
            self.counts[layer].scatter_add_(0, flat, torch.ones_like(flat))
        self._seen.clear()

    def add_balance(self, value: torch.Tensor) -> None:
        value = value.detach().double()
        self.balance_sum = value if self.balance_sum is None else self.balance_sum + value
        self.balance_n += 1

    def local(self) -> dict[str, Any]:
        """This process's figures, for `merge_router_stats` (host values: a gather of objects)."""
        return {"layers": self.layers, "experts": self.experts, "top_k": self.top_k,
                "counts": None if self.counts is None else self.counts.cpu().tolist(),
                "balance_sum": None if self.balance_sum is None else self.balance_sum.item(),
                "balance_n": self.balance_n}


def router_stats(causal_lm: nn.Module) -> RouterStats | None:
    """The model's RouterStats, None when it has no router transformers records."""
    recorder = (getattr(causal_lm, "_can_record_outputs", None) or {}).get("router_logits")
    kind = getattr(recorder, "target_class", None)
    if kind is None:
        return None
    routers = [(n, m) for n, m in causal_lm.named_modules() if isinstance(m, kind) and hasattr(m, "weight")]
    return RouterStats(routers) if routers else None


def merge_router_stats(per_rank: list[dict[str, Any]], coef: float | None) -> dict[str, Any]:
    """metrics.json's `router` section from every rank's `RouterStats.local()`."""
    first = per_rank[0]
    counts = [r["counts"] for r in per_rank if r["counts"] is not None]
    total = [[sum(c[i][e] for c in counts) for e in range(first["experts"])] for i in range(len(first["layers"]))]
    n = sum(r["balance_n"] for r in per_rank)
    balance = sum(r["balance_sum"] for r in per_rank if r["balance_sum"] is not None) / n if n else None
    top_k = next((r["top_k"] for r in per_rank if r["top_k"]), None)
    return {"layers": first["layers"], "experts": first["experts"], "top_k": top_k,
            "tokens_per_expert": total if counts else None,
            "balance_loss_mean": balance, "balance_micro_batches": n, "aux_loss_coef": coef if n else None}


def float64_experts_(hf_model: nn.Module) -> str | None:
    """Switch a model whose expert code has no float64 kernel to transformers' eager experts
    ([Note: float64 experts]); returns the implementation it replaced, or None."""
    current = getattr(hf_model.config, "_experts_implementation", None)
    can_set = getattr(type(hf_model), "_can_set_experts_implementation", None)
    if current in (None, FLOAT64_EXPERTS) or can_set is None or not can_set():
        return None
    hf_model.set_experts_implementation(FLOAT64_EXPERTS)
    return current
