"""The Python entry to shardlab's loop: your own model, data and loss, trained by the loop
`shardlab train` runs (docs/python.md).

    @shardlab.register_model("regressor", loss=torch.nn.functional.mse_loss)
    def build() -> nn.Module: ...                     # built on the meta device; shardlab initializes it

    @shardlab.register_data("pairs")
    def pairs(cfg) -> tuple[Dataset, Dataset]: ...    # (train, validation); each item (input, target)

    if __name__ == "__main__":                        # examples/python_fit.py runs it
        raise SystemExit(shardlab.fit({"model": {"name": "regressor"}, "data": {"source": "pairs"}}).exit_code)

[Note: registration, not a model object]
Lightning's Trainer and accelerate take the model object; torchtitan registers a builder under a
name that its config selects. shardlab does the second, because a run is more than one process
at one time: a resume at another world size, `shardlab verify` (which builds the model again in
its own workers, in float64), `shardlab export`/`eval` (which rebuild it from the checkpoint's
record) all need the model *from its name*. `register_model` and `register_data` put a
`ModelSpec` and a `DataSource` into the registries the catalogue's own models and sources live
in, so from there on nothing tells them apart: `fit(config)` is `shardlab train` without
`--nproc` (this process is one worker: under torchrun, srun, a pod, or alone), through the same
`worker_main` and `train(cfg, rt)`; there is no second loop. The other commands find a script's
registrations when the script is importable without training (its `fit` call under
`if __name__ == "__main__":`) and named in SHARDLAB_PLUGINS.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import nn

from shardlab.data import DATA_SOURCES
from shardlab.data.datasets import Datasets
from shardlab.data.source import DataSource
from shardlab.errors import ConfigError
from shardlab.models import MODELS
from shardlab.models.spec import DATA_KINDS, ModelSpec

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# -- registering a model and a data source ----------------------------------------------------------
def register_model(name: str, build: Callable[[], nn.Module] | None = None, *, loss: LossFn | None = None,
                   data_kind: str = "vectors") -> Any:
    """Make `model.name=NAME` build `build()` (also usable as `@register_model(NAME, ...)`).

    build: returns the module, on the current default device (the meta device for the sharded
    engines, which then materialize and initialize only what each rank holds: by shardlab's
    name-keyed init, or the module's own `shardlab_initialize_(modules, names)`).
    loss: `loss(outputs, targets)`, the mean loss of a micro batch; without it the module's
    `forward(inputs, targets=None)` returns that loss itself when targets are given.
    data_kind: what it takes ("tokens", "images", "vectors"), which of shardlab's own data
    sources may feed it (`data.source=synthetic` shapes its samples for that kind)."""
    if build is None:
        return lambda fn: register_model(name, fn, loss=loss, data_kind=data_kind)
    if data_kind not in DATA_KINDS:
        raise ValueError(f"register_model({name!r}): data_kind {data_kind!r} is not one of {', '.join(DATA_KINDS)}")
    _refuse_builtin(name, MODELS, "model", _registered_models)

    def make(*_: Any) -> nn.Module:
        module = build()
        if not isinstance(module, nn.Module):
            raise TypeError(f"the builder of model {name!r} returned a {type(module).__name__}, not an nn.Module")
        return with_loss(module, loss) if loss is not None else module

    MODELS[name] = ModelSpec(name=name, data_kind=data_kind, build=make, record=lambda model: {},
                             rebuild=lambda kwargs, seed: make())
    _registered_models.add(name)
    return build


def register_data(name: str, build: Callable[[Any], Any] | None = None) -> Any:
    """Make `data.source=NAME` train on `build(cfg)` (also usable as `@register_data(NAME)`).

    build: the run's Config -> a map-style Dataset (training only) or (train, validation); each
    item an (input, target) pair of tensors, which the loop stacks into micro batches. Every
    worker calls it; the step-indexed sampler picks each rank's samples, so a resume at any
    world size reads the same samples at the same step."""
    if build is None:
        return lambda fn: register_data(name, fn)
    _refuse_builtin(name, DATA_SOURCES, "data source", _registered_sources)

    def make(cfg: Any) -> Datasets:
        built = build(cfg)
        train, val = built if isinstance(built, tuple) else (built, None)
        for part, dataset in (("train", train), ("validation", val)):
            if dataset is not None and not hasattr(dataset, "__getitem__"):
                raise TypeError(f"data source {name!r}: its {part} set is a {type(dataset).__name__}, "
                                "not a map-style Dataset (one with __getitem__ and __len__)")
        return Datasets(train, val, info={"source": name, "train_samples": len(train)})

    DATA_SOURCES[name] = DataSource(name=name, kind=None, build=make)
    _registered_sources.add(name)
    return build


# the names registered through this module: each may be registered again (a script imported twice)
_registered_models: set[str] = set()
_registered_sources: set[str] = set()


def _refuse_builtin(name: str, registry: Mapping[str, Any], what: str, ours: set[str]) -> None:
    if name in registry and name not in ours:
        raise ValueError(f"{what} {name!r} is shardlab's own (or another plugin's): register yours under another "
                         "name")


def with_loss(module: nn.Module, loss: LossFn) -> nn.Module:
    """`module`, whose forward(inputs, targets) now returns loss(forward(inputs), targets).

    The instance's class becomes a subclass of its own (as FSDP2's `fully_shard` does), so
    its parameter names, its state dict and every engine's hooks stay the module's own: a
    wrapper module would prefix every name."""
    base = type(module)

    def forward(self: nn.Module, inputs: Any, targets: torch.Tensor | None = None) -> Any:
        outputs = base.forward(self, inputs)
        return outputs if targets is None else loss(outputs, targets)

    module.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})
    return module


# -- the entry --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FitResult:
    """What `fit` returns: the exit code `shardlab train` would give (0 done, 75 preempted and
    saved: the same call resumes) and where the run's files are."""

    exit_code: int
    run_dir: str

    @property
    def preempted(self) -> bool:
        from shardlab.loop.preemption import PREEMPTED_EXIT_CODE

        return self.exit_code == PREEMPTED_EXIT_CODE

    @property
    def metrics(self) -> dict[str, Any] | None:
        """metrics.json as rank 0 wrote it (None before it exists)."""
        from shardlab.atomic import read_json

        found = read_json(os.path.join(self.run_dir, "metrics.json"))
        return found if isinstance(found, dict) else None


def fit(config: str | Mapping[str, Any] | None = None, overrides: Sequence[str] = (), *,
        fresh: bool = False) -> FitResult:
    """Train as `shardlab train CONFIG key=value ...` does without --nproc: this process is one
    worker (under torchrun, srun or a pod), or the only one. fresh: `--fresh`, from step 0 in a
    new run directory beside the one the config names (one process only: workers cannot agree on it).

    config: a YAML file, a shipped config's name, or a mapping of sections (`{"train": {"steps":
    6}}`; dotted keys too: `{"train.steps": 6}`); overrides: "key=value" strings. A bad config
    prints one line naming the key and exits 2 (SystemExit), before any process group exists."""
    from shardlab.data import prepare_datasets
    from shardlab.loop.run import run_dir
    from shardlab.loop.run_contract import settle
    from shardlab.loop.runtime import env_world, in_launched_worker
    from shardlab.loop.train import worker_main

    say = env_world()[0] == 0  # one line, not one per rank
    try:
        cfg = resolve_config(config, overrides)
    except ConfigError as e:
        _exit_bad_input(e, say)
    worker = in_launched_worker()
    # as `shardlab train` decides before its workers: the run name, and a finished run said in one
    # line with nothing started ([Note: the run contract] in loop/run_contract.py)
    settled = settle(cfg, fresh, worker, elastic=False)
    if settled == 2:
        raise SystemExit(2)  # settle printed why
    if settled is not None:
        return FitResult(settled, run_dir(cfg.output))
    if not worker:  # alone: as `shardlab train`; workers prepare together (local rank 0 first)
        try:
            prepare_datasets(cfg)
        except ValueError as e:
            _exit_bad_input(e, say)
    return FitResult(worker_main(cfg), run_dir(cfg.output))


def _exit_bad_input(e: Exception, say: bool) -> NoReturn:
    if say:
        print(f"error: {e}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def resolve_config(config: str | Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> Any:
    """The Config `fit` trains with, checked at this process's world size."""
    from shardlab.config import config_from_dict, load_config, validate_for_world
    from shardlab.config_parse import _parse_override, _set_dotted
    from shardlab.loop.runtime import env_world

    if isinstance(overrides, str):
        raise ConfigError(f"fit(..., overrides={overrides!r}): give a list of key=value strings")
    if config is None or isinstance(config, (str, os.PathLike)):
        cfg = load_config(None if config is None else os.fspath(config), list(overrides))
    elif isinstance(config, Mapping):
        raw: dict[str, Any] = {}
        for key, value in copy.deepcopy(dict(config)).items():
            if "." in key:  # {"train.steps": 6}
                _set_dotted(raw, key, value)
            elif isinstance(value, dict):  # {"train": {"steps": 6}}, merged with dotted keys of that section
                raw.setdefault(key, {}).update(value)
            else:  # {"seed": 1}
                raw[key] = value
        for item in overrides:
            _set_dotted(raw, *_parse_override(item))
        cfg = config_from_dict(raw)
    else:
        raise ConfigError(f"fit's config is a {type(config).__name__}: give a YAML path, a shipped config's name "
                          "or a mapping of sections")
    validate_for_world(cfg, env_world()[2])
    return cfg
