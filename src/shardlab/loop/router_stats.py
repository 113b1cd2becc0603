"""metrics.json's `router` section: what a mixture of experts' routers did over the steps this run
trained, every rank's figures gathered once at the end ([Note: router statistics] in
models/hf_router.py). Called by `RunMeasurements.summary` on every rank; a model without routers
adds nothing and gathers nothing."""

from __future__ import annotations

from typing import Any

from shardlab.loop.runtime import all_gather_object
from shardlab.models.hf_router import merge_router_stats


def router_section(run: Any) -> dict[str, Any]:
    """{"router": {...}} for a model with `router_stats` (models/hf_model.py), else {}."""
    model = run.engine.unwrapped()
    stats = getattr(model, "router_stats", None)
    if stats is None:
        return {}
    per_rank = all_gather_object(stats.local(), run.rt)
    coef = getattr(model.hf_model, "router_aux_loss_coef", None) if model.router_fn is not None else None
    return {"router": merge_router_stats(per_rank, coef)}
