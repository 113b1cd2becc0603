"""Step time: compute from the probed step's operations (plan/clock.py) and communication from an
alpha-beta model per collective kind, over the collectives each engine says a step issues
(`Plannable.step_traffic`, engines/planning.py)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from shardlab.config import Config, engine_options
from shardlab.engines import engine_class
from shardlab.engines.api import MixedPrecision
from shardlab.engines.compile import Checkpointing
from shardlab.engines.planning import Collective, ModelTraffic
from shardlab.models import MODELS, repeated_blocks
from shardlab.observe.flops import compute_dtype
from shardlab.plan.catalogue import GPU, Link
from shardlab.plan.clock import (
    Machine,
    compute_seconds,
    gpu_machine,
    least_sure,
    main_dtype,
    narrow_step,
    operation_seconds,
    step_seconds,
)
from shardlab.plan.model import meta_model, n_layer, param_count
from shardlab.plan.ops import Census, dtype_name, totals


def collective_time(kind: str, nbytes: float, world: int, link: Link) -> float:
    """Ring model: all_reduce 2(W-1) steps moving 2(W-1)/W of the buffer per rank; all_gather and
    reduce_scatter (W-1) steps moving (W-1)/W of the full buffer; broadcast (pipelined chain)
    ceil(log2 W) latency steps and the whole buffer once. nbytes: the full (unsharded) size."""
    if world <= 1:
        return 0.0
    steps, bus = {"all_reduce": (2 * (world - 1), 2 * (world - 1) / world),
                  "all_gather": (world - 1, (world - 1) / world),
                  "reduce_scatter": (world - 1, (world - 1) / world),
                  "broadcast": (math.ceil(math.log2(world)), 1.0),
                  "reduce": (math.ceil(math.log2(world)), 1.0)}[kind]
    alpha, bandwidth = link.constants(kind)
    return steps * alpha + bus * nbytes / bandwidth


def model_traffic(cfg: Config, world: int, mixed_precision: MixedPrecision | None = None) -> ModelTraffic:
    """What the engines' traffic depends on, from the meta model: parameter bytes in the dtype
    they are gathered in (the engine's `mixed_precision.param_dtype`), trainable bytes in the
    dtype gradients are reduced in (its `reduce_dtype`, parallel.reduce_dtype), root bytes, wrap
    units. No policy (fp32, or an engine that takes none): the parameters' own dtype."""
    model = meta_model(cfg)
    units = repeated_blocks(model)
    in_units = {id(p) for u in units for p in u.parameters()}
    params = list({id(p): p for p in model.parameters()}.values())
    mp = mixed_precision or MixedPrecision()

    def nbytes(ps, dtype: torch.dtype | None) -> int:
        return sum(p.numel() * (dtype.itemsize if dtype is not None else p.element_size()) for p in ps)

    gathered, reduced = mp.param_dtype, mp.reduce_dtype or mp.param_dtype
    return ModelTraffic(param_bytes=nbytes(params, gathered),
                        trainable_bytes=nbytes([p for p in params if p.requires_grad], reduced),
                        root_bytes=nbytes([p for p in params if id(p) not in in_units], gathered), units=len(units),
                        micro_batches=max(1, cfg.train.global_batch_size // (world * cfg.train.micro_batch_size)),
                        world=world, tensors=len(params), trainable_tensors=sum(p.requires_grad for p in params))


def comm_plan(cfg: Config, engine: str, world: int) -> list[Collective]:
    """(kind, full bytes per call, calls per step, ranks in the group) of an engine's training
    collectives, as its design says (`Plannable.step_traffic`); groups of one rank send nothing."""
    if world == 1:
        return []
    c = copy.deepcopy(cfg)
    c.parallel.strategy = engine
    options = engine_options(c.parallel)
    planned = engine_class(engine).step_traffic(model_traffic(cfg, world, options.get("mixed_precision")), options)
    return [x for x in planned if x.ranks > 1]


def comm_seconds(cfg: Config, engine: str, world: int, link: Link) -> float:
    return sum(calls * collective_time(kind, b, ranks, link) for kind, b, calls, ranks in comm_plan(cfg, engine, world))


def exposed_seconds(plan: list[Collective], link: Link) -> float:
    """The collectives no compute can hide ([Note: plan's clock] in plan/clock.py): a step's first
    gather (nothing to compute before it) and its last reduce (nothing left after it), each taken as
    the largest call of its kind."""
    def largest(kinds: tuple[str, ...]) -> float:
        return max((collective_time(kind, b, ranks, link) for kind, b, calls, ranks in plan
                    if kind in kinds and calls), default=0.0)

    return largest(("all_gather", "broadcast")) + largest(("reduce_scatter", "all_reduce", "reduce"))


def step_time(cfg: Config, engine: str, world: int, link: Link, gpu: GPU | None, probe_seconds: float | None = None,
              nodes: int = 1, step_flops: float | None = None, census: Census | None = None,
              machine: Machine | None = None) -> dict[str, Any]:
    """Predicted step time ([Note: plan's clock] in plan/clock.py): the probed step's operations
    (`census`, plan/ops.py) each at what `machine` (default: the GPU's, plan/clock.py) does for its
    kind, the engine's collectives over the link, overlapped as the device allows. Without a census:
    the FLOPs a rank executes (`step_flops`, counted on the probe's step, else 6*Psi*tokens plus what
    checkpointing recomputes) at the matmul ceiling of the compute dtype. probe_seconds: unused, kept
    for callers of the old signature."""
    t = cfg.train
    tokens_per_sample = MODELS[cfg.model.name].tokens_per_sample(cfg.data.seq_len)
    tokens_rank = t.global_batch_size // world * tokens_per_sample
    m = machine or gpu_machine(gpu)
    if census:
        parts = operation_seconds(census, m, cfg, engine)
        flops = sum(f * calls for (_k, _o, _d, _s, f, _b), calls in census.items())
        source = f"the probed step's operations at {m.name}'s rates"
    else:
        if step_flops:
            flops, counted = step_flops, "FLOPs counted on the probe's step"
        else:  # 6 = forward 2 + backward 4 per parameter and token; checkpointing adds the recomputed forward's 2
            recomputed = Checkpointing(t.activation_checkpointing, t.ac_every).recomputed_share(n_layer(cfg))
            flops, counted = (6 + 2 * recomputed) * param_count(cfg) * tokens_rank, "6*Psi*tokens (+ recompute)"
        dtype = dtype_name(compute_dtype(t.precision))
        parts = dict.fromkeys(("matmul", "attention", "memory", "optimizer", "host"), 0.0)
        parts["matmul"] = flops / m.ceiling(dtype) * m.slowdown
        source = f"{counted} at the {dtype} matmul ceiling {m.ceiling(dtype) / 1e12:.3g} TFLOP/s"
    compute = compute_seconds(parts, m)
    plan = comm_plan(cfg, engine, world)
    narrow = narrow_step(m, cfg, engine) if census else None
    if narrow is not None and narrow.collectives:
        comm = 0.0  # every collective, bytes and waits, is in the step measured on a real group (plan/cpu.py)
    else:
        comm = sum(calls * collective_time(kind, b, ranks, link) for kind, b, calls, ranks in plan)
        # on a CPU the bytes are moved by the ranks' own cores (gloo's threads copy them through the kernel's
        # loopback); the link was fitted with a core per rank, so more ranks than cores stretch it as they
        # stretch the arithmetic
        comm *= m.slowdown
    step = step_seconds(compute, comm, exposed_seconds(plan, link), m)
    tokens_step = t.global_batch_size * tokens_per_sample
    return {"compute_s": compute, "comm_s": comm, "flops_per_token": flops / tokens_rank, "step_s": step,
            "step_serial_s": compute + comm, "tokens_per_s": tokens_step / step if step else None,
            "compute_source": source, "comm_hidden": m.overlaps and comm <= compute, "link": link.name,
            "comm_in_host": bool(narrow is not None and narrow.collectives),
            "parts_s": parts, "least_sure": least_sure(parts, comm, m, bool(census), main_dtype(census) if census else None),
            "operations": totals(census) if census else None, "machine_sources": m.sources}


def hiding_limit(cfg: Config, engine: str, per_node: int, link: Link, compute_s: float, world: int | None = None,
                 max_nodes: int = 1024) -> int | None:
    """The first node count at which the step's communication exceeds its compute, i.e. stops
    hiding behind it; None if it never does up to max_nodes. Each rank's work stays as configured
    at `world` ranks (default: one node): the same micro batch and number of micro batches, so
    the same compute. A shard group spanning the configured world (plain FSDP) spans every
    world tried; a smaller one (hybrid sharding) stays its size."""
    world = world or per_node
    micro = cfg.train.micro_batch_size
    accumulation = max(1, cfg.train.global_batch_size // (micro * world))
    shard_size = cfg.parallel.shard_size
    spans_world = shard_size is not None and shard_size >= world
    c = copy.deepcopy(cfg)
    k = 1
    while k <= max_nodes:
        ranks = per_node * k
        c.train.global_batch_size = micro * ranks * accumulation
        if spans_world:
            c.parallel.shard_size = ranks
        if comm_seconds(c, engine, ranks, link) > compute_s:
            return k
        k *= 2
    return None
