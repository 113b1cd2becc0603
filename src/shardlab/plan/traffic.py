"""Step time: compute from FLOPs (or the probe's measured CPU step) and communication from an
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
from shardlab.plan.catalogue import GPU, MFU, Link
from shardlab.plan.model import meta_model, n_layer, param_count


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


def step_time(cfg: Config, engine: str, world: int, link: Link, gpu: GPU | None, probe_seconds: float | None,
              nodes: int = 1, step_flops: float | None = None) -> dict[str, Any]:
    """Predicted step time: compute and communication (alpha-beta); overlapped = max(compute,
    comm) for engines that overlap (all do: bucketed all-reduce, prefetch), serial = compute + comm.
    Compute on a GPU: the FLOPs a rank executes per step at peak FLOP/s x MFU, the FLOPs counted on
    the probe's step (`step_flops`: matmuls and attention, recomputation included) or, without
    one, 6*Psi*tokens plus what checkpointing recomputes; on CPU: the probe's measured step."""
    t = cfg.train
    tokens_per_sample = MODELS[cfg.model.name].tokens_per_sample(cfg.data.seq_len)
    tokens_rank = t.global_batch_size // world * tokens_per_sample
    if step_flops:
        flops, counted = step_flops, "FLOPs counted on the probe's step"
    else:  # 6 = forward 2 + backward 4 per parameter and token; checkpointing adds the recomputed forward's 2
        recomputed = Checkpointing(t.activation_checkpointing, t.ac_every).recomputed_share(n_layer(cfg))
        flops, counted = (6 + 2 * recomputed) * param_count(cfg) * tokens_rank, "6*Psi*tokens (+ recompute)"
    if gpu is not None:
        compute = flops / (gpu.peak_flops * MFU)
        source = f"{counted}, {flops / tokens_rank:.3g} per token, at {gpu.peak_flops / 1e12:.0f} TFLOP/s x MFU {MFU:g}"
    else:
        compute = probe_seconds or float("nan")
        source = "the probe's measured step on this CPU, scaled"
    comm = comm_seconds(cfg, engine, world, link)
    overlapped = max(compute, comm)
    tokens_step = t.global_batch_size * tokens_per_sample
    return {"compute_s": compute, "comm_s": comm, "flops_per_token": flops / tokens_rank, "step_s": overlapped,
            "step_serial_s": compute + comm, "tokens_per_s": tokens_step / overlapped if overlapped else None,
            "compute_source": source, "comm_hidden": comm <= compute, "link": link.name}


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
