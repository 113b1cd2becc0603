"""Typed configuration: dataclasses loaded from YAML, with dotted `key=value` overrides.

Every error is found here, before any worker process starts, and the message names the
key and the fix: unknown keys (with a "did you mean"), wrong types, values out of range,
unknown strategy/model/data source (listing the valid ones), a batch that does not divide
over the workers, a missing data path, a YAML syntax error (file and line).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from shardlab.data import DATA_SOURCES
from shardlab.data.layout import layout_for
from shardlab.engines import STRATEGIES, engine_class
from shardlab.engines.api import ACCUMULATE_MODES, CPUOffload, MixedPrecision
from shardlab.engines.collectives import resolve_shard_size
from shardlab.engines.compile import AC_MODES, COMPILE_MODES
from shardlab.errors import ConfigError
from shardlab.models import MODELS
from shardlab.models.lm_loss import LOSS_MODES
from shardlab.observe.trackers import resolve_trackers
from shardlab.shipped import config_path, shipped_configs


@dataclass
class _ModelName:
    name: str = "gpt"                      # a key of shardlab.models.MODELS
    sync_batchnorm: bool = False           # BatchNorm statistics over all ranks (distributed engines; docs/verify.md)


# The `model:` section: the name, then every registered model's own keys (each model file
# declares them in its ModelSpec.keys), so the YAML keys stay flat (model.preset,
# model.resnet_width, ...) and a new model adds its keys without touching this file.
ModelConfig = dataclass(type("ModelConfig", (*reversed(list(dict.fromkeys(spec.keys for spec in MODELS.values()))),
                                             _ModelName),
                             {"__module__": __name__, "__doc__": "model.name plus every model's keys"}))


@dataclass
class DataConfig:
    source: str = "builtin"                # builtin | text | tokens | sft | cifar10 | synthetic
    path: Optional[str] = None             # tokens: a DATA_DIR from `shardlab prepare`; text: file, directory or
                                           # glob; sft: a JSON/JSONL file (null: the
                                           # embedded instruction set); cifar10: folder with cifar-10-batches-py
    mix: Optional[dict[str, float]] = None  # tokens: {DATA_DIR: weight, ...}, a weighted mixture of prepared
                                           # corpora instead of data.path (docs/data.md, "Mixtures")
    tokenizer: Optional[str] = None        # text: a local directory with tokenizer.json (null = bytes)
    tokenizer_path: Optional[str] = None   # sft: a local directory with tokenizer.json (null: model.hf_path's,
                                           # else a BPE trained at run time)
    packing: bool = False                  # sft: several examples per row (attention and loss never cross)
    seq_len: int = 128                     # text, sft: tokens per sample
    val_fraction: float = 0.05             # prepare's --val-fraction default too (tokens: fixed at prepare)
    val_from_train: bool = False           # tokens: a corpus without a val split holds out the last
                                           # val_fraction of its train windows for validation
    synthetic_samples: int = 4096
    shuffle: bool = True
    num_workers: Optional[int] = None      # DataLoader worker processes per rank (null: 2 on CUDA, 0 on CPU)


@dataclass
class TrainConfig:
    steps: int = 20
    global_batch_size: int = 16
    micro_batch_size: int = 4
    lr: float = 1e-3
    min_lr_ratio: float = 0.1              # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 2
    optimizer: str = "adamw"               # adamw | sgd
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    momentum: float = 0.0                  # sgd
    grad_clip: float = 1.0                 # 0 = off
    precision: str = "fp32"                # fp32 | bf16 | fp16 (autocast; fp16 adds dynamic loss scaling)
    loss_scale: float = 65536.0            # fp16: initial loss scale (halved on overflow)
    loss_scale_growth_interval: int = 2000  # fp16: good steps in a row before the scale doubles
    loss: str = "auto"                     # auto | chunked | full: the LM loss without whole logits (docs/training.md)
    activation_checkpointing: str = "none"  # none | full | selective (docs/training.md); true/false: old spellings
    ac_every: int = 1                      # checkpoint blocks 0, K, 2K, ... (1: every block)
    compile: bool = False                  # torch.compile each block (inductor; hooks stay outside)
    compile_mode: Optional[str] = None     # torch.compile mode: null (default) | reduce-overhead | max-autotune | ...
    eval_every: int = 0                    # 0 = only at the end
    eval_batches: int = 4
    log_every: int = 1
    memory_tracking: str = "last"          # live tensor bytes by part/phase (docs/memory.md): last | all | none
    profile: bool = False                  # torch.profiler Chrome trace of a few steps -> <run dir>/profile/
    profile_steps: int = 2                 # steps traced, after the first step of the run


@dataclass
class ParallelConfig:
    strategy: str = "fsdp"                 # a key of shardlab.engines.STRATEGIES
    # The keys below reach the engines that take them (their `options`; engine_options):
    reshard_after_forward: bool = True     # free gathered parameters after each unit's forward
    mixed_precision: str = "fp32"          # fp32 | bf16 | fp16: engine compute/communication dtype (fp64: verify's)
    reduce_dtype: Optional[str] = None     # gradients reduced in: null = as mixed_precision | fp32 | bf16 | fp16
    bucket_size_mb: float = 25.0           # gradient buckets of the all-reducing engines
    prefetch: bool = True                  # gather the next unit while this one computes
    shard_size: Optional[int] = None       # hybrid sharding over S ranks (null = ranks per node)
    offload: str = "none"                  # none | cpu: keep shards, grads and optimizer state on the host
    accumulate: str = "local"              # local | sharded: micro batches' gradients summed whole, or in the shard
    backend: str = "auto"                  # auto (nccl on CUDA, else gloo) | gloo | nccl
    timeout_s: float = 300.0               # every collective; a dead rank fails the others within it
    wrap_classes: Optional[list[str]] = None  # wrap units by class name (null: the model's default units)


@dataclass
class CheckpointConfig:
    every_steps: int = 0                   # 0 = off
    every_seconds: Optional[float] = None  # also save when this many seconds passed since the last save
    final: bool = True                     # save the last step's state when training ends (export, eval)
    keep_last: int = 2
    dir: Optional[str] = None              # null = <run dir>/checkpoints
    resume: str = "auto"                   # auto | none | a checkpoint path
    async_save: bool = False               # YAML key: checkpoint.async


@dataclass
class PreemptionConfig:
    """What a SIGTERM/SIGUSR1 does and how long the job must be given for it (docs/preemption.md)."""

    enabled: bool = True                   # save a checkpoint and exit 75 on SIGTERM/SIGUSR1
    grace_s: Optional[float] = None        # signal-to-exit seconds; null = ceil(2 x save + margin_s)
    save_s: Optional[float] = None         # one save; null = measured (newest checkpoint) or estimated
    write_mb_s: float = 100.0              # storage write speed the estimate assumes
    margin_s: float = 30.0                 # the step in flight, process exit, filesystem latency


@dataclass
class DoctorConfig:
    """The hang doctor (docs/debugging.md): each rank's heartbeat and collective record."""

    enabled: bool = True                   # <run dir>/debug: flight files, stack dumps, exit records
    record_size: int = 4096                # collectives kept per rank (a ring: the last ones)


@dataclass
class OutputConfig:
    dir: str = "runs"
    run_name: Optional[str] = None         # null = <model>-<strategy>-<timestamp>
    tensorboard: bool = True               # kept for older configs: with trackers unset, [tensorboard] or none
    trackers: Optional[list[str]] = None   # tensorboard | wandb | mlflow (observe/trackers.py); null: see above
    progress: bool = True


@dataclass
class ExportConfig:
    format: str = "none"                   # none | hf: at the end of training, write a Hugging Face directory
    dir: Optional[str] = None              # null = <run dir>/hf
    lora: str = "merged"                   # merged (adapters folded into the weights) | adapter (peft adapter alone)


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
        return _to_dict(self)


# YAML keys that are not valid Python names map to fields here.
_ALIASES = {("checkpoint", "async"): "async_save"}
_ALIASES_BACK = {(sec, fld): key for (sec, key), fld in _ALIASES.items()}
# Keys that were true/false and became a choice: the old spellings still load, with a
# deprecation note. (section, key) -> {old: new}
_BOOL_SPELLINGS = {("train", "activation_checkpointing"): {True: "full", False: "none"}}

# The choices come from the registries, read when a config is checked (so an engine or model
# registered after this module was imported, by a plugin or a test, is a valid choice too): a new
# engine, model or data source needs no edit here.


def strategies_taking(option: str) -> tuple[str, ...]:
    """The strategies whose engine takes `option` (its class's `options`). Importing every engine
    class costs about 0.02 s once torch is loaded (which `import shardlab` does anyway)."""
    return tuple(s for s in STRATEGIES if option in engine_class(s).options)


def _to_dict(obj: Any, section: str = "") -> Any:
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            key = _ALIASES_BACK.get((section, f.name), f.name)
            out[key] = _to_dict(getattr(obj, f.name), f.name)
        return out
    if isinstance(obj, list):
        return list(obj)
    if isinstance(obj, dict):
        return dict(obj)
    return obj


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML, loadable by load_config."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


# ---------------------------------------------------------------------------------------- loading
def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load YAML (or defaults when path is None), apply `a.b=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        if config_path(path) is None:
            raise ConfigError(f"config file {path!r} not found; give a path to a YAML file or the name of a "
                              f"shipped config ({', '.join(shipped_configs())}; `shardlab configs` lists them)")
        path = config_path(path)
        with open(path) as f:
            text = f.read()
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError(f"{where}: YAML syntax error: {problem}; fix the YAML at that line") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, train:, ...), "
                              f"not a {type(loaded).__name__}")
        raw = loaded
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value)
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a Config from a nested mapping (e.g. `Config.to_dict()` stored in a checkpoint)."""
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value, e.g. train.steps=100")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has no key before '='")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text  # an unparseable value is taken as a plain string; type checks follow
    return key, value


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}=...: {part!r} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _known_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = _ALIASES_BACK.get((prefix.rstrip("."), f.name), f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _known_keys(hints[f.name], prefix + name + ".")
        else:
            keys.append(prefix + name)
    return keys


def _unknown_key_error(full_key: str) -> ConfigError:
    known = _known_keys(Config)
    close = difflib.get_close_matches(full_key, known, n=1, cutoff=0.6)
    if not close:  # try the last component alone: "train.step" vs "train.steps", "lr" vs "train.lr"
        last = full_key.split(".")[-1]
        close = [k for k in known if difflib.get_close_matches(last, [k.split(".")[-1]], cutoff=0.75)][:1]
    hint = f"; did you mean {close[0]!r}?" if close else "; run `shardlab train --print-config` to see every key"
    return ConfigError(f"unknown config key {full_key!r}{hint}")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    section = prefix.rstrip(".")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{section or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    by_key = {_ALIASES_BACK.get((section, f.name), f.name): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in by_key:
            while isinstance(value, dict) and len(value) == 1:  # misspelt section: name the whole key
                (sub, value), = value.items()
                full = f"{full}.{sub}"
            raise _unknown_key_error(full)
        f = by_key[key]
        tp = hints[f.name]
        value = _renew_bool_spelling(section, key, value)
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, value, full + ".")
        else:
            kwargs[f.name] = _coerce(value, tp, full)
    return cls(**kwargs)


def _renew_bool_spelling(section: str, key: str, value: Any) -> Any:
    spellings = _BOOL_SPELLINGS.get((section, key))
    if spellings is None or not isinstance(value, bool):
        return value
    new = spellings[value]
    # warn_explicit: the note is about the user's config, not a line of shardlab's source
    warnings.warn_explicit(f"{section}.{key}={str(value).lower()} is deprecated and means {new}: write "
                           f"{section}.{key}={new}", FutureWarning, filename="shardlab config", lineno=0)
    return new


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {' to '.join(_type_name(a) for a in typing.get_args(tp))}"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    bad = ConfigError(f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if origin is list:
        if not isinstance(value, list):
            raise bad
        return [_coerce(v, typing.get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        key_type, value_type = typing.get_args(tp)
        return {_coerce(k, key_type, f"{key} key"): _coerce(v, value_type, f"{key}[{k}]") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise bad
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    return value


# ------------------------------------------------------------------------------------- validation
def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{key}: unknown value {value!r}; valid: {', '.join(choices)}")


def validate(cfg: Config) -> None:
    """Checks that need no knowledge of the world size, section by section."""
    _check(cfg.seed >= 0, f"seed must be >= 0, got {cfg.seed}")
    _choice("model.name", cfg.model.name, tuple(MODELS))
    spec = MODELS[cfg.model.name]
    spec.check(cfg.model)  # the model's own keys
    _validate_data(cfg, spec)
    _validate_train(cfg, spec)
    _validate_parallel(cfg.parallel)
    _validate_export(cfg)
    _validate_checkpoint_and_preemption(cfg)
    resolve_trackers(cfg.output)  # known and installed, else the extra to install


def _validate_data(cfg: Config, spec: Any) -> None:
    m, d = cfg.model, cfg.data
    _choice("data.source", d.source, tuple(DATA_SOURCES))
    source = DATA_SOURCES[d.source]
    _check(d.mix is None or d.source == "tokens", f"data.mix (a mixture of prepared corpora) applies to "
           f"data.source=tokens, not {d.source}; set data.source=tokens or remove data.mix")
    source.check(cfg)  # the source's own keys
    _check(d.num_workers is None or d.num_workers >= 0, f"data.num_workers must be >= 0, got {d.num_workers}")
    kind = source.kind  # what the source yields; None (synthetic) yields what the model takes
    if kind is not None and spec.data_kind != kind:
        fits = [name for name, other in MODELS.items() if other.data_kind == kind]
        _check(False, f"data.source={d.source} gives {kind}, but model.name={m.name} takes {spec.data_kind}; "
               f"use model.name={' or '.join(fits)}, or data.source=synthetic")
    if d.tokenizer_path is not None:
        _check(os.path.isfile(os.path.join(d.tokenizer_path, "tokenizer.json")),
               f"data.tokenizer_path {d.tokenizer_path!r}: no tokenizer.json in that directory; point it at a "
               "local tokenizer directory (or null for model.hf_path's, else one trained at run time)")
    packs = [name for name, s in DATA_SOURCES.items() if s.packing]
    _check(not d.packing or source.packing, f"data.packing applies to data.source={' or '.join(packs)} only")
    problem = spec.packing_problem(m) if d.packing else None
    _check(problem is None, problem or "")
    if d.tokenizer is not None:
        _check(os.path.isfile(os.path.join(d.tokenizer, "tokenizer.json")),
               f"data.tokenizer {d.tokenizer!r}: no tokenizer.json in that directory")
    _check(d.seq_len >= 2, f"data.seq_len must be >= 2, got {d.seq_len}")
    _check(0.0 <= d.val_fraction < 0.5, f"data.val_fraction must be in [0, 0.5), got {d.val_fraction}")
    _check(d.synthetic_samples >= 1, "data.synthetic_samples must be >= 1")


def _validate_train(cfg: Config, spec: Any) -> None:
    m, d, t = cfg.model, cfg.data, cfg.train
    _check(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    _check(t.global_batch_size >= 1, f"train.global_batch_size must be >= 1, got {t.global_batch_size}")
    _check(t.micro_batch_size >= 1, f"train.micro_batch_size must be >= 1, got {t.micro_batch_size}")
    _check(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _check(0.0 <= t.min_lr_ratio <= 1.0, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    _check(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    _choice("train.optimizer", t.optimizer, ("adamw", "sgd"))
    _check(t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    _check(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)")
    _check(t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 = off), got {t.grad_clip}")
    _choice("train.precision", t.precision, ("fp32", "bf16", "fp16"))
    _choice("train.loss", t.loss, LOSS_MODES)
    heads = [name for name, other in MODELS.items() if other.loss_head]
    _check(t.loss != "chunked" or spec.loss_head, f"train.loss=chunked: model.name={m.name} has no output projection "
           f"over a vocabulary to chunk (models with one: {', '.join(heads)}); set train.loss=auto or full")
    _check(t.loss_scale > 0 and t.loss_scale_growth_interval >= 1,
           "train.loss_scale must be > 0 and train.loss_scale_growth_interval >= 1")
    _check(t.eval_every >= 0 and t.eval_batches >= 1 and t.log_every >= 1,
           "train.eval_every must be >= 0, train.eval_batches and train.log_every >= 1")
    _choice("train.memory_tracking", t.memory_tracking, ("last", "all", "none"))
    _choice("train.activation_checkpointing", t.activation_checkpointing, AC_MODES)
    _check(t.ac_every >= 1, f"train.ac_every must be >= 1 (1 = every block), got {t.ac_every}")
    _check(t.compile_mode in COMPILE_MODES, f"train.compile_mode: unknown value {t.compile_mode!r}; valid: null, "
           f"{', '.join(m for m in COMPILE_MODES if m)}")
    _check(t.compile or t.compile_mode is None, "train.compile_mode applies with train.compile=true; set "
           "train.compile=true or remove train.compile_mode")
    _check(t.profile_steps >= 1, f"train.profile_steps must be >= 1, got {t.profile_steps}")
    block = spec.max_seq_len(m) if spec.data_kind == "tokens" else None
    if block is not None:
        _check(d.seq_len <= block, f"data.seq_len ({d.seq_len}) exceeds the model's block_size ({block}); "
               f"lower data.seq_len or set model.block_size >= {d.seq_len}")


def _validate_parallel(p: ParallelConfig) -> None:
    """The engine's options are checked against the options its class takes."""
    _choice("parallel.strategy", p.strategy, tuple(STRATEGIES))
    _choice("parallel.mixed_precision", p.mixed_precision, ("fp32", "bf16", "fp16", "fp64"))
    if p.reduce_dtype is not None:
        _choice("parallel.reduce_dtype", p.reduce_dtype, ("fp32", "bf16", "fp16", "fp64"))
    _choice("parallel.backend", p.backend, ("auto", "gloo", "nccl"))
    _check(p.bucket_size_mb > 0, f"parallel.bucket_size_mb must be > 0, got {p.bucket_size_mb}")
    _check(p.timeout_s > 0, f"parallel.timeout_s must be > 0, got {p.timeout_s}")
    _choice("parallel.offload", p.offload, ("none", "cpu"))
    takes = engine_class(p.strategy).options
    if p.reduce_dtype is not None and "mixed_precision" not in takes:
        _check(False, f"parallel.reduce_dtype={p.reduce_dtype} sets the dtype gradients are reduced in, which "
               f"parallel.strategy={p.strategy} does not take (it communicates in the parameters' dtype): use "
               f"parallel.strategy={' or '.join(strategies_taking('mixed_precision'))}, or parallel.reduce_dtype=null")
    if p.mixed_precision != "fp32" and "mixed_precision" not in takes:
        _check(False, f"parallel.mixed_precision={p.mixed_precision} sets the dtype the engine computes and communicates "
               f"in, which parallel.strategy={p.strategy} does not take (it would run in the parameters' dtype): use "
               f"parallel.strategy={' or '.join(strategies_taking('mixed_precision'))}"
               + (f", train.precision={p.mixed_precision} (autocast)" if p.mixed_precision != "fp64" else "")
               + ", or parallel.mixed_precision=fp32")
    if p.offload != "none" and "offload" not in takes:
        _check(False, f"parallel.offload={p.offload} needs a sharded engine; parallel.strategy={p.strategy} keeps the "
               f"whole model on every device: use parallel.strategy={' or '.join(strategies_taking('offload'))}, "
               "or parallel.offload=none")
    _choice("parallel.accumulate", p.accumulate, ACCUMULATE_MODES)
    if p.accumulate != "local" and "accumulate" not in takes:
        _check(False, f"parallel.accumulate={p.accumulate} sums each micro batch's reduced gradient in a gradient "
               f"shard, an option of parallel.strategy={' or '.join(strategies_taking('accumulate'))} only, not of "
               f"{p.strategy}: use one of those, or parallel.accumulate=local")
    if p.shard_size is not None:
        _check(p.shard_size >= 1, f"parallel.shard_size must be >= 1 (or null for the ranks per node), "
               f"got {p.shard_size}")
        if "shard_size" not in takes:
            _check(False, f"parallel.shard_size (hybrid sharding) applies to parallel.strategy="
                   f"{' or '.join(strategies_taking('shard_size'))}, not {p.strategy}; remove parallel.shard_size "
                   "or change the strategy")
    if p.wrap_classes is not None:
        _check(all(isinstance(n, str) and n for n in p.wrap_classes),
               "parallel.wrap_classes must be a list of module class names, e.g. [MistralDecoderLayer]")


def _validate_export(cfg: Config) -> None:
    m, e = cfg.model, cfg.export
    _choice("export.format", e.format, ("none", "hf"))
    _choice("export.lora", e.lora, ("merged", "adapter"))
    if e.format == "hf":
        _check(m.name in ("hf", "gpt"), f"export.format=hf exports model.name=hf or gpt, not {m.name}")


def _validate_checkpoint_and_preemption(cfg: Config) -> None:
    c = cfg.checkpoint
    _check(c.every_steps >= 0, f"checkpoint.every_steps must be >= 0 (0 = off), got {c.every_steps}")
    _check(c.every_seconds is None or c.every_seconds > 0,
           f"checkpoint.every_seconds must be > 0 (or null: off), got {c.every_seconds}")
    _check(c.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {c.keep_last}")
    _check(c.resume in ("auto", "none") or os.path.exists(c.resume),
           f"checkpoint.resume must be auto, none or an existing checkpoint path; {c.resume!r} does not exist")
    pre = cfg.preemption
    _check(pre.grace_s is None or pre.grace_s >= 1, f"preemption.grace_s must be >= 1 or null, got {pre.grace_s}")
    _check(pre.save_s is None or pre.save_s > 0, f"preemption.save_s must be > 0 or null, got {pre.save_s}")
    _check(pre.write_mb_s > 0, f"preemption.write_mb_s must be > 0, got {pre.write_mb_s}")
    _check(pre.margin_s >= 0, f"preemption.margin_s must be >= 0, got {pre.margin_s}")
    _check(16 <= cfg.doctor.record_size <= 2**20,
           f"doctor.record_size must be between 16 and {2**20} collectives, got {cfg.doctor.record_size}")


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
    _check(world_size >= 1, f"the number of workers must be >= 1, got {world_size}")
    engine = engine_class(cfg.parallel.strategy)
    if not engine.distributed:
        distributed = [s for s in STRATEGIES if engine_class(s).distributed]
        _check(world_size == 1, f"parallel.strategy={cfg.parallel.strategy} runs one process, but {world_size} workers "
               f"were asked for; use --nproc 1 or a distributed strategy ({', '.join(distributed)})")
    if "shard_size" in engine.options:
        try:
            resolve_shard_size(cfg.parallel.shard_size, world_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    layout_for(t.global_batch_size, t.micro_batch_size, world_size)  # the rule: data/layout.py
