"""The model as plan sees it, and each engine's exact model state per rank.

The model is built on the meta device (no memory); what each engine keeps between steps comes
from the engine itself (`Plannable.planned_state`, engines/planning.py): by its rule where it has one,
else by building it for real on the meta device on a fake process group of N ranks
(`torch.testing._internal.distributed.fake_pg`), in a child process, so its padding and
ownership are its own. Parameters + buffers, gradients and optimizer state (AdamW: two moments
+ a 4-byte step per tensor; SGD with momentum: one buffer) are exact; the maximum over ranks is
taken. What the model answers (its depth, how to cut it, its vocabulary) is its `ModelSpec`'s.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import tempfile
from typing import Any

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import shardlab
from shardlab.config import (
    Config,
    ParallelConfig,
    TrainConfig,
    config_from_dict,
    engine_options,
    strategies_taking,
)
from shardlab.data import DATA_SOURCES
from shardlab.engines import engine_class
from shardlab.engines.planning import LocalTensor
from shardlab.models import MODELS, build_model, count_parameters


# -- the model, from its ModelSpec ----------------------------------------------------------------
def vocab_size(cfg: Config) -> int | None:
    """The vocabulary the real run builds the model with, for a model whose config key fixes it
    (`ModelSpec.vocab_key`): the key's value, else what the data's tokenizer offers, else the
    synthetic data's. None: the model fixes its own."""
    spec = MODELS[cfg.model.name]
    if spec.vocab_key is None:
        return None
    own = getattr(cfg.model, spec.vocab_key)
    if own:
        return own
    return DATA_SOURCES[cfg.data.source].vocab_size(cfg) or spec.synthetic(cfg.model).get("vocab_size")


def meta_model(cfg: Config):
    return build_model(cfg.model, seed=cfg.seed, vocab_size=vocab_size(cfg), device="meta")


def chunked_instead(cfg: Config) -> bool:
    """Whether plan probes `train.loss=chunked` beside the config: it asks for the full loss of a
    model whose `auto` would chunk (a vocabulary larger than its width, a head the chunked loss follows)."""
    if cfg.train.loss != "full" or not MODELS[cfg.model.name].loss_head:
        return False
    model = meta_model(cfg)
    return model.use_loss("auto") is None and model.loss == "chunked"


def n_layer(cfg: Config) -> int | None:
    """Blocks of a model whose depth the probes cut (`ModelSpec.depth`); None for models that run whole."""
    return MODELS[cfg.model.name].depth(cfg.model)


def cut_depth(raw: dict, n: int, tmpdir: str) -> None:
    """Cut the model of config dict `raw` to `n` blocks, in place (`ModelSpec.cut_depth`)."""
    MODELS[raw["model"]["name"]].cut_depth(raw["model"], n, tmpdir)


def param_count(cfg: Config) -> int:
    return count_parameters(meta_model(cfg))


def probe_param_bytes(cfg: Config, layers: int) -> int:
    """Parameter bytes of the probe model (the model cut to `layers` blocks; the same for every engine)."""
    raw = cfg.to_dict()
    with tempfile.TemporaryDirectory(prefix="shardlab-plan-") as tmp:
        if layers and MODELS[cfg.model.name].cut_depth is not None:
            cut_depth(raw, layers, tmp)
        model = meta_model(config_from_dict(raw))
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


# -- each engine's state -------------------------------------------------------------------------
def engine_config(cfg: Config, engine: str, world: int, per_node: int | None = None) -> Config:
    """The config as `engine` would run it: options it does not take are dropped (shard_size,
    offload, mixed_precision, reduce_dtype, accumulate: its class's `options`), and hybrid sharding's default S, the ranks per node, is made
    explicit (`per_node`, from --nproc)."""
    c = copy.deepcopy(cfg)
    c.parallel.strategy = engine
    if engine not in strategies_taking("shard_size"):
        c.parallel.shard_size = None
    elif c.parallel.shard_size is None:
        c.parallel.shard_size = per_node if per_node and per_node < world else world
    if engine not in strategies_taking("offload"):
        c.parallel.offload = "none"
    if engine not in strategies_taking("mixed_precision"):  # it computes in the parameters' dtype
        c.parallel.reduce_dtype, c.parallel.mixed_precision = None, "fp32"
    if engine not in strategies_taking("accumulate"):
        c.parallel.accumulate = "local"  # no shard: every rank holds the whole gradient anyway
    return c


def _optimizer_bytes(t: TrainConfig, tensors: list[LocalTensor]) -> int:
    """Optimizer state bytes of a rank's trainable local tensors."""
    trainable = [x for x in tensors if x.trainable]
    if t.optimizer == "adamw":
        return sum(2 * x.numel * x.element_size + 4 for x in trainable)  # exp_avg, exp_avg_sq, a 0-dim fp32 step
    return sum(x.numel * x.element_size for x in trainable) if t.momentum > 0 else 0


def _state_bytes(t: TrainConfig, tensors: list[LocalTensor], buffers: int) -> dict[str, int]:
    """params (+ buffers, whole on every rank), grads and optimizer bytes of one rank."""
    return {"params": sum(x.numel * x.element_size for x in tensors) + buffers,
            "grads": sum(x.numel * x.element_size for x in tensors if x.trainable),
            "optimizer": _optimizer_bytes(t, tensors)}


def _largest(t: TrainConfig, ranks: list[list[LocalTensor]], buffers: int) -> dict[str, int]:
    best: dict[str, int] | None = None
    for tensors in ranks:
        st = _state_bytes(t, tensors, buffers)
        if best is None or sum(st.values()) > sum(best.values()):
            best = st
    assert best is not None
    return best


def _plan_options(p: ParallelConfig) -> dict[str, Any]:
    """The engine's options as the state rule sees them: offload moves state, it does not size it."""
    return {k: v for k, v in engine_options(p).items() if k != "offload"}


def model_state(cfg: Config, engine: str, nproc: int) -> dict[str, int]:
    """Exact bytes per rank (the maximum over ranks) of parameters + buffers, gradients and
    optimizer state the engine keeps between steps. Runs in a child process when the engine must
    be built on a fake process group (so this process keeps no process group)."""
    state = state_by_rule(cfg, engine, nproc)
    if state is not None:
        return state
    c = copy.deepcopy(cfg)
    c.parallel.strategy = engine
    return in_child(built_state, c.to_dict(), engine, nproc)


def state_by_rule(cfg: Config, engine: str, nproc: int) -> dict[str, int] | None:
    """model_state by the engine's rule (`Plannable.planned_state`); None when only building it tells."""
    model = meta_model(cfg)
    params = list({id(p): p for p in model.parameters()}.values())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    c = copy.deepcopy(cfg)
    c.parallel.strategy = engine
    ranks = engine_class(engine).planned_state(params, nproc, _plan_options(c.parallel))
    return None if ranks is None else _largest(cfg.train, ranks, buffers)


def built_state(raw: dict, engine: str, nproc: int) -> dict[str, int]:
    """`engine` built on the meta device on a fake N-rank group, at the ranks it names
    (`planned_ranks`), each telling what it knows of the ranks' local tensors (`rank_states`)."""

    cfg = config_from_dict(raw)
    states: list[list[LocalTensor]] = []
    buffers = 0
    for rank in engine_class(engine).planned_ranks(nproc):
        init_fake_group(rank, nproc)
        try:
            m = shardlab.parallelize(meta_model(cfg), engine, device="meta", **_plan_options(cfg.parallel))
            e = shardlab.engine_of(m)
            buffers = sum(b.numel() * b.element_size() for b in e.unwrapped().buffers())
            states += e.rank_states()
        finally:
            dist.destroy_process_group()
    return _largest(cfg.train, states, buffers)


# -- processes -------------------------------------------------------------------------------------
def init_fake_group(rank: int, world: int) -> None:
    """A process group of `world` ranks whose collectives return at once, without peers."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def in_child(fn, *args, timeout_s: float = 1800.0):
    """Run fn(*args) in a spawned process (its own process group and memory); return its result.
    The child imports shardlab afresh: engines and models registered outside it come from
    SHARDLAB_PLUGINS (shardlab/__init__.py), which it inherits."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        res = pool.apply_async(fn, args)
        return res.get(timeout_s)
