"""The config checks that need no registry's code, only its names: ranges, choices, files named
by a key. `check_sections` runs inside every `load_config` (config.py adds what the models, data
sources and engines check themselves), and `precheck` runs it in the CLI before torch is imported,
so `shardlab train CONFIG bogus.key=1` answers in a fraction of torch's import time.

[Note: the registries' names without their code]
The registries (MODELS, STRATEGIES, DATA_SOURCES) live in modules that import torch, and what the
`model:` section takes is declared in each model's file. The CLI's early check cannot import
them, so it reads `SHIPPED` and `MODEL_KEYS` below: the names those registries hold when nothing
was added to them, which tests/test_cli_fast.py checks equal to the live registries. A plugin
(SHARDLAB_PLUGINS, or a module that registers in-process) extends a registry by importing it, so
`precheck` steps aside whenever a registry module is already imported: then the full load, which
reads the live registries, is the only judge, as it always is after `precheck` passes.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlab.config_parse import build, read_raw
from shardlab.config_sections import SECTIONS, ModelName
from shardlab.errors import ConfigError


@dataclass(frozen=True)
class Choices:
    """The names `model.name`, `parallel.strategy` and `data.source` take."""

    models: tuple[str, ...]
    strategies: tuple[str, ...]
    sources: tuple[str, ...]


# The registries' names as shipped ([Note: the registries' names without their code]); the engines'
# are read from engines/__init__.py itself (`shipped_choices`), the one place engine names are written.
SHIPPED_MODELS = ("gpt", "resnet", "mlp", "hf")
SHIPPED_SOURCES = ("builtin", "text", "tokens", "sft", "cifar10", "synthetic")
# Every key the shipped models add below `model:` (after name and sync_batchnorm), in ModelConfig's order.
MODEL_KEYS = ("preset", "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "dropout", "resnet_blocks",
              "resnet_width", "num_classes", "mlp_sizes", "hf_path", "hf_config", "hf_dtype", "hf_attention",
              "lora.rank", "lora.alpha", "lora.dropout", "lora.target_modules")
# Choices defined beside the code that takes them (models/lm_loss.py, engines/compile.py, engines/api.py),
# copied here for the same reason; the same test checks them.
LOSS_MODES = ("auto", "chunked", "full")
AC_MODES = ("none", "full", "selective")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
ACCUMULATE_MODES = ("local", "sharded")
DTYPES = ("fp32", "bf16", "fp16", "fp64")
# Where the registries live: once one is imported, its live names count.
REGISTRY_MODULES = ("shardlab.models", "shardlab.engines", "shardlab.data")


@functools.cache
def shipped_choices() -> Choices:
    """The shipped registries' names, torch not imported: STRATEGIES' keys as engines/__init__.py
    writes them (its dict literal, parsed, not run), the models' and data sources' from above."""
    tree = ast.parse((Path(__file__).parent / "engines" / "__init__.py").read_text(encoding="utf-8"))
    table = next(node.value for node in ast.walk(tree) if isinstance(node, ast.AnnAssign)
                 and getattr(node.target, "id", None) == "STRATEGIES")
    return Choices(models=SHIPPED_MODELS, strategies=tuple(ast.literal_eval(k) for k in table.keys),
                   sources=SHIPPED_SOURCES)


def strategy_names() -> tuple[str, ...]:
    """`parallel.strategy`'s choices: the registry's when it is imported (plugins' entries included),
    else the shipped ones, without importing torch."""
    engines = sys.modules.get("shardlab.engines")
    return tuple(engines.STRATEGIES) if engines is not None else shipped_choices().strategies


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    check(value in choices, f"{key}: unknown value {value!r}; valid: {', '.join(choices)}")


# ---------------------------------------------------------------------------------- the early check
def precheck(path: str | None, overrides: list[str] | tuple[str, ...]) -> None:
    """Every error `check_sections` and the key and type checks can find, before torch is imported:
    raises ConfigError. Model keys are checked by name only (their types: the full load)."""
    if any(name in sys.modules for name in REGISTRY_MODULES):
        return  # a registry is loaded, maybe extended: the full load judges with it
    raw = read_raw(path, overrides)
    with warnings.catch_warnings():  # an old spelling's note: the full load gives it, once
        warnings.simplefilter("ignore", FutureWarning)
        cfg = build(config_shape(MODEL_KEYS), raw)
    check_sections(cfg, shipped_choices())


def config_shape(model_keys: tuple[str, ...]) -> type:
    """A dataclass shaped as config.Config whose `model:` section takes `model_keys` (dotted below
    it) as values of any type: what the early check builds a config into."""
    model = _section("ModelKeys", model_keys, (ModelName,))
    fields: list[tuple[str, Any, Any]] = [("seed", int, 0)]
    for name, cls in {"model": model, **SECTIONS}.items():
        fields.append((name, cls, field(default_factory=cls)))
    return dataclasses.make_dataclass("Config", fields)


def _section(name: str, keys: tuple[str, ...], bases: tuple[type, ...] = ()) -> type:
    """A dataclass whose fields are `keys` (a dotted key: a nested section), each of any type."""
    nested = {}
    for key in keys:
        head, _, rest = key.partition(".")
        nested.setdefault(head, []).append(rest)
    fields: list[tuple[str, Any, Any]] = []
    for head, rests in nested.items():
        if all(rests):
            sub = _section(head, tuple(rests))
            fields.append((head, sub, field(default_factory=sub)))
        else:
            fields.append((head, Any, None))
    return dataclasses.make_dataclass(name, fields, bases=bases)


# ----------------------------------------------------------------------------------- the checks
def check_sections(cfg: Any, choices: Choices) -> None:
    """Checks that need no world size and no registry's code, section by section."""
    check(cfg.seed >= 0, f"seed must be >= 0, got {cfg.seed}")
    choice("model.name", cfg.model.name, choices.models)
    _check_data(cfg.data, choices)
    _check_train(cfg.train)
    _check_parallel(cfg.parallel, choices)
    _check_export(cfg)
    _check_checkpoint_and_preemption(cfg)


def _check_data(d: Any, choices: Choices) -> None:
    choice("data.source", d.source, choices.sources)
    check(d.mix is None or d.source == "tokens", f"data.mix (a mixture of prepared corpora) applies to "
          f"data.source=tokens, not {d.source}; set data.source=tokens or remove data.mix")
    check(d.num_workers is None or d.num_workers >= 0, f"data.num_workers must be >= 0, got {d.num_workers}")
    if d.tokenizer_path is not None:
        check(os.path.isfile(os.path.join(d.tokenizer_path, "tokenizer.json")),
              f"data.tokenizer_path {d.tokenizer_path!r}: no tokenizer.json in that directory; point it at a "
              "local tokenizer directory (or null for model.hf_path's, else one trained at run time)")
    if d.tokenizer is not None:
        check(os.path.isfile(os.path.join(d.tokenizer, "tokenizer.json")),
              f"data.tokenizer {d.tokenizer!r}: no tokenizer.json in that directory")
    check(d.seq_len >= 2, f"data.seq_len must be >= 2, got {d.seq_len}")
    check(0.0 <= d.val_fraction < 0.5, f"data.val_fraction must be in [0, 0.5), got {d.val_fraction}")
    check(d.synthetic_samples >= 1, "data.synthetic_samples must be >= 1")


def _check_train(t: Any) -> None:
    check(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    check(t.global_batch_size >= 1, f"train.global_batch_size must be >= 1, got {t.global_batch_size}")
    check(t.micro_batch_size >= 1, f"train.micro_batch_size must be >= 1, got {t.micro_batch_size}")
    check(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    check(0.0 <= t.min_lr_ratio <= 1.0, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    check(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    choice("train.optimizer", t.optimizer, ("adamw", "sgd"))
    check(t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    check(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)")
    check(t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 = off), got {t.grad_clip}")
    choice("train.precision", t.precision, ("fp32", "bf16", "fp16"))
    choice("train.loss", t.loss, LOSS_MODES)
    check(t.loss_scale > 0 and t.loss_scale_growth_interval >= 1,
          "train.loss_scale must be > 0 and train.loss_scale_growth_interval >= 1")
    check(t.eval_every >= 0 and t.eval_batches >= 1 and t.log_every >= 1,
          "train.eval_every must be >= 0, train.eval_batches and train.log_every >= 1")
    choice("train.memory_tracking", t.memory_tracking, ("last", "all", "none"))
    choice("train.activation_checkpointing", t.activation_checkpointing, AC_MODES)
    check(t.ac_every >= 1, f"train.ac_every must be >= 1 (1 = every block), got {t.ac_every}")
    check(t.compile_mode in COMPILE_MODES, f"train.compile_mode: unknown value {t.compile_mode!r}; valid: null, "
          f"{', '.join(m for m in COMPILE_MODES if m)}")
    check(t.compile or t.compile_mode is None, "train.compile_mode applies with train.compile=true; set "
          "train.compile=true or remove train.compile_mode")
    check(t.profile_steps >= 1, f"train.profile_steps must be >= 1, got {t.profile_steps}")


def _check_parallel(p: Any, choices: Choices) -> None:
    """The values alone; which options the chosen engine takes: config.py."""
    choice("parallel.strategy", p.strategy, choices.strategies)
    choice("parallel.mixed_precision", p.mixed_precision, DTYPES)
    if p.reduce_dtype is not None:
        choice("parallel.reduce_dtype", p.reduce_dtype, DTYPES)
    choice("parallel.backend", p.backend, ("auto", "gloo", "nccl"))
    check(p.bucket_size_mb > 0, f"parallel.bucket_size_mb must be > 0, got {p.bucket_size_mb}")
    check(p.timeout_s > 0, f"parallel.timeout_s must be > 0, got {p.timeout_s}")
    choice("parallel.offload", p.offload, ("none", "cpu"))
    choice("parallel.accumulate", p.accumulate, ACCUMULATE_MODES)
    if p.shard_size is not None:
        check(p.shard_size >= 1, f"parallel.shard_size must be >= 1 (or null for the ranks per node), "
              f"got {p.shard_size}")
    if p.wrap_classes is not None:
        check(all(isinstance(n, str) and n for n in p.wrap_classes),
              "parallel.wrap_classes must be a list of module class names, e.g. [MistralDecoderLayer]")


def _check_export(cfg: Any) -> None:
    m, e = cfg.model, cfg.export
    choice("export.format", e.format, ("none", "hf"))
    choice("export.lora", e.lora, ("merged", "adapter"))
    if e.format == "hf":
        check(m.name in ("hf", "gpt"), f"export.format=hf exports model.name=hf or gpt, not {m.name}")


def _check_checkpoint_and_preemption(cfg: Any) -> None:
    c = cfg.checkpoint
    check(c.every_steps >= 0, f"checkpoint.every_steps must be >= 0 (0 = off), got {c.every_steps}")
    check(c.every_seconds is None or c.every_seconds > 0,
          f"checkpoint.every_seconds must be > 0 (or null: off), got {c.every_seconds}")
    check(c.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {c.keep_last}")
    check(c.resume in ("auto", "none") or os.path.exists(c.resume),
          f"checkpoint.resume must be auto, none or an existing checkpoint path; {c.resume!r} does not exist")
    pre = cfg.preemption
    check(pre.grace_s is None or pre.grace_s >= 1, f"preemption.grace_s must be >= 1 or null, got {pre.grace_s}")
    check(pre.save_s is None or pre.save_s > 0, f"preemption.save_s must be > 0 or null, got {pre.save_s}")
    check(pre.write_mb_s > 0, f"preemption.write_mb_s must be > 0, got {pre.write_mb_s}")
    check(pre.margin_s >= 0, f"preemption.margin_s must be >= 0, got {pre.margin_s}")
    check(16 <= cfg.doctor.record_size <= 2**20,
          f"doctor.record_size must be between 16 and {2**20} collectives, got {cfg.doctor.record_size}")
