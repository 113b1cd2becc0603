"""The model registry: every name `model.name` accepts, each with its config keys, builder and
rebuild record (`ModelSpec`, models/spec.py). Adding a model: one file, one line in MODELS.

Every model's forward is `forward(inputs, targets=None)` and returns the mean loss when
targets are given, so the training loop and the engines never look inside a model.
`repeated_blocks(model)` names the units an engine wraps by default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from shardlab.models import gpt, hf, mlp, resnet
from shardlab.models.gpt import GPT, GPT_PRESETS, GPTConfig
from shardlab.models.init import canonical_names, init_parameters_
from shardlab.models.lm_loss import announce
from shardlab.models.mlp import MLPModel
from shardlab.models.resnet import ResNet
from shardlab.models.spec import ModelSpec

__all__ = ["GPT", "GPTConfig", "GPT_PRESETS", "MLPModel", "ResNet", "MODELS", "ModelSpec", "model_spec",
           "build_model", "rebuild_model", "model_record", "repeated_blocks", "outermost_modules", "init_parameters_",
           "canonical_names", "count_parameters"]

# name -> spec. The order is the order help texts list them in.
MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (gpt.SPEC, resnet.SPEC, mlp.SPEC, hf.SPEC)}


def model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    return MODELS[name]


def build_model(section: Any, *, seed: int = 0, vocab_size: int | None = None,
                device: str | torch.device = "cpu", loss: str | None = None) -> nn.Module:
    """Build the model a config's `model:` section describes. On device="meta" only shapes
    exist; an engine then materializes what it holds. vocab_size: what the data offers.
    loss: train.loss for a model with a loss head (ModelSpec.loss_head); None keeps its full loss.
    A meta model is built outside any active FakeTensorMode (plan's fake probes): its
    parameters must be plain meta tensors, which an engine materializes into fake ones; a
    FakeTensor parameter could only be swapped, and the fake mode's memo forbids that."""
    spec = model_spec(section.name)
    with _no_fake_mode() if torch.device(device).type == "meta" else contextlib.nullcontext(), torch.device(device):
        model = spec.build(section, seed, vocab_size)
    if loss is not None and spec.loss_head:
        announce(model.use_loss(loss))
    return model


def _no_fake_mode():
    from torch._subclasses.fake_tensor import unset_fake_temporarily  # deferred: only for meta builds

    return unset_fake_temporarily()


def model_record(name: str, model: nn.Module, seed: int) -> dict[str, Any]:
    """JSON that `rebuild_model` turns back into the same architecture (checkpoints keep it)."""
    return {"name": name, "seed": seed, "kwargs": model_spec(name).record(model)}


def rebuild_model(record: dict[str, Any], device: str | torch.device = "cpu") -> nn.Module:
    with torch.device(device):
        return model_spec(record["name"]).rebuild(record["kwargs"], record["seed"])


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The default wrap units below the root: the modules of the classes the model names in
    `wrap_classes()` (a transformers model: its decoder layers), else every child of an
    nn.ModuleList of blocks (GPT blocks, MLP layers) and every ResNet stage, in forward order."""
    classes = tuple(model.wrap_classes()) if hasattr(model, "wrap_classes") else ()
    if classes:
        return outermost_modules(model, lambda m: isinstance(m, classes))
    units: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            units.extend(module.children())
    return units


def outermost_modules(model: nn.Module, predicate: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The modules below the root for which `predicate` is true and no ancestor's is, in module
    (forward) order."""
    found: list[nn.Module] = []
    taken: set[int] = set()
    for name, m in model.named_modules():
        if m is model or any(id(a) in taken for a in _ancestors(model, name)):
            continue
        if predicate(m):
            found.append(m)
            taken.add(id(m))
    return found


def _ancestors(model: nn.Module, name: str) -> Iterator[nn.Module]:
    m = model
    for part in name.split(".")[:-1] if name else []:
        m = getattr(m, part)
        yield m


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Elements of the distinct parameters (tied ones once); trainable_only: requires_grad only."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()
               if p.requires_grad or not trainable_only)
