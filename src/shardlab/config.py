"""Typed configuration: dataclasses loaded from YAML, with dotted `key=value` overrides.

Every error is found here, before any worker process starts, and the message names the
key and the fix: unknown keys (with a "did you mean"), wrong types, values out of range,
unknown strategy/model/data source (listing the valid ones), a batch that does not divide
over the workers, a missing data path, a YAML syntax error (file and line).

The parts, each its own module: the sections' dataclasses (config_sections.py), reading and
building them (config_parse.py), the checks that need no registry's code (config_checks.py,
which the CLI also runs before torch is imported); here the `model:` section, which every model
adds its keys to, and the checks the models, data sources and engines answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from shardlab.config_checks import Choices, check, check_sections
from shardlab.config_parse import build, read_raw, to_dict
from shardlab.config_sections import (
    CheckpointConfig,
    DataConfig,
    DoctorConfig,
    ExportConfig,
    ModelName,
    OutputConfig,
    ParallelConfig,
    PreemptionConfig,
    TrainConfig,
)
from shardlab.data import DATA_SOURCES
from shardlab.data.loader import layout_for
from shardlab.engines import STRATEGIES, engine_class
from shardlab.engines.api import CPUOffload, MixedPrecision
from shardlab.engines.collectives import resolve_shard_size
from shardlab.errors import ConfigError
from shardlab.models import MODELS
from shardlab.observe.trackers import resolve_trackers

__all__ = ["Config", "ModelConfig", "DataConfig", "TrainConfig", "ParallelConfig", "CheckpointConfig",
           "PreemptionConfig", "DoctorConfig", "OutputConfig", "ExportConfig", "ConfigError", "load_config",
           "config_from_dict", "dump_config", "validate", "validate_for_world", "engine_options",
           "strategies_taking"]

# The `model:` section: the name, then every registered model's own keys (each model file
# declares them in its ModelSpec.keys), so the YAML keys stay flat (model.preset,
# model.resnet_width, ...) and a new model adds its keys without touching this file.
ModelConfig = dataclass(type("ModelConfig", (*reversed(list(dict.fromkeys(spec.keys for spec in MODELS.values()))),
                                             ModelName),
                             {"__module__": __name__, "__doc__": "model.name plus every model's keys"}))


@dataclass
class Config:
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML, loadable by load_config."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load YAML (or defaults when path is None; a shipped config's name works too), apply
    `a.b=value` overrides, validate."""
    return config_from_dict(read_raw(path, overrides))


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a Config from a nested mapping (e.g. `Config.to_dict()` stored in a checkpoint)."""
    cfg = build(Config, raw)
    validate(cfg)
    return cfg


# ------------------------------------------------------------------------------------- validation
# The choices come from the registries, read when a config is checked (so an engine or model
# registered after this module was imported, by a plugin or a test, is a valid choice too): a new
# engine, model or data source needs no edit here.
def registered() -> Choices:
    """The names the registries hold now, plugins' included."""
    return Choices(models=tuple(MODELS), strategies=tuple(STRATEGIES), sources=tuple(DATA_SOURCES))


def strategies_taking(option: str) -> tuple[str, ...]:
    """The strategies whose engine takes `option` (its class's `options`). Importing every engine
    class costs about 0.02 s once torch is loaded (which the registries import anyway)."""
    return tuple(s for s in STRATEGIES if option in engine_class(s).options)


def validate(cfg: Config) -> None:
    """Checks that need no knowledge of the world size: the values (config_checks.py), then
    what the model, the data source and the engine say of them."""
    check_sections(cfg, registered())
    spec = MODELS[cfg.model.name]
    spec.check(cfg.model)  # the model's own keys
    _validate_data(cfg, spec)
    _validate_train(cfg, spec)
    _validate_engine_options(cfg.parallel)
    resolve_trackers(cfg.output)  # known and installed, else the extra to install


def _validate_data(cfg: Config, spec: Any) -> None:
    m, d = cfg.model, cfg.data
    source = DATA_SOURCES[d.source]
    source.check(cfg)  # the source's own keys
    kind = source.kind  # what the source yields; None (synthetic) yields what the model takes
    if kind is not None and spec.data_kind != kind:
        fits = [name for name, other in MODELS.items() if other.data_kind == kind]
        check(False, f"data.source={d.source} gives {kind}, but model.name={m.name} takes {spec.data_kind}; "
              f"use model.name={' or '.join(fits)}, or data.source=synthetic")
    packs = [name for name, s in DATA_SOURCES.items() if s.packing]
    check(not d.packing or source.packing, f"data.packing applies to data.source={' or '.join(packs)} only")
    problem = spec.packing_problem(m) if d.packing else None
    check(problem is None, problem or "")


def _validate_train(cfg: Config, spec: Any) -> None:
    m, d, t = cfg.model, cfg.data, cfg.train
    heads = [name for name, other in MODELS.items() if other.loss_head]
    check(t.loss != "chunked" or spec.loss_head, f"train.loss=chunked: model.name={m.name} has no output projection "
          f"over a vocabulary to chunk (models with one: {', '.join(heads)}); set train.loss=auto or full")
    block = spec.max_seq_len(m) if spec.data_kind == "tokens" else None
    if block is not None:
        check(d.seq_len <= block, f"data.seq_len ({d.seq_len}) exceeds the model's block_size ({block}); "
              f"lower data.seq_len or set model.block_size >= {d.seq_len}")


def _validate_engine_options(p: ParallelConfig) -> None:
    """The `parallel.*` options set against those the engine's class takes."""
    takes = engine_class(p.strategy).options
    if p.reduce_dtype is not None and "mixed_precision" not in takes:
        check(False, f"parallel.reduce_dtype={p.reduce_dtype} sets the dtype gradients are reduced in, which "
              f"parallel.strategy={p.strategy} does not take (it communicates in the parameters' dtype): use "
              f"parallel.strategy={' or '.join(strategies_taking('mixed_precision'))}, or parallel.reduce_dtype=null")
    if p.mixed_precision != "fp32" and "mixed_precision" not in takes:
        check(False, f"parallel.mixed_precision={p.mixed_precision} sets the dtype the engine computes and communicates "
              f"in, which parallel.strategy={p.strategy} does not take (it would run in the parameters' dtype): use "
              f"parallel.strategy={' or '.join(strategies_taking('mixed_precision'))}"
              + (f", train.precision={p.mixed_precision} (autocast)" if p.mixed_precision != "fp64" else "")
              + ", or parallel.mixed_precision=fp32")
    if p.offload != "none" and "offload" not in takes:
        check(False, f"parallel.offload={p.offload} needs a sharded engine; parallel.strategy={p.strategy} keeps the "
              f"whole model on every device: use parallel.strategy={' or '.join(strategies_taking('offload'))}, "
              "or parallel.offload=none")
    if p.accumulate != "local" and "accumulate" not in takes:
        check(False, f"parallel.accumulate={p.accumulate} sums each micro batch's reduced gradient in a gradient "
              f"shard, an option of parallel.strategy={' or '.join(strategies_taking('accumulate'))} only, not of "
              f"{p.strategy}: use one of those, or parallel.accumulate=local")
    if p.shard_size is not None and "shard_size" not in takes:
        check(False, f"parallel.shard_size (hybrid sharding) applies to parallel.strategy="
              f"{' or '.join(strategies_taking('shard_size'))}, not {p.strategy}; remove parallel.shard_size "
              "or change the strategy")


def engine_options(p: ParallelConfig) -> dict[str, Any]:
    """The `parallel.*` keys as the options of the engine they configure, those it takes
    (its class's `options`): what `shardlab.parallelize` gets."""
    offered = {
        "reshard_after_forward": p.reshard_after_forward,
        "mixed_precision": MixedPrecision.from_names(p.mixed_precision, p.reduce_dtype),
        "bucket_size_bytes": int(p.bucket_size_mb * 2**20),
        "prefetch": p.prefetch,
        "shard_size": p.shard_size,
        "offload": CPUOffload.parse(p.offload),
        "accumulate": p.accumulate,
    }
    accepted = engine_class(p.strategy).options
    return {k: v for k, v in offered.items() if k in accepted}


def validate_for_world(cfg: Config, world_size: int) -> None:
    """Checks that need the number of workers; run before they start."""
    t = cfg.train
    check(world_size >= 1, f"the number of workers must be >= 1, got {world_size}")
    engine = engine_class(cfg.parallel.strategy)
    if not engine.distributed:
        distributed = [s for s in STRATEGIES if engine_class(s).distributed]
        check(world_size == 1, f"parallel.strategy={cfg.parallel.strategy} runs one process, but {world_size} workers "
              f"were asked for; use --nproc 1 or a distributed strategy ({', '.join(distributed)})")
    if "shard_size" in engine.options:
        try:
            resolve_shard_size(cfg.parallel.shard_size, world_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    layout_for(t.global_batch_size, t.micro_batch_size, world_size)  # the rule: data/loader.py
