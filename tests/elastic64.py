"""SHARDLAB_PLUGINS=tests.elastic64: model.name=gpt64, shardlab's GPT with float64 parameters, so
that `shardlab train` runs in float64 end to end (tests/parity.py, [Note: why the harness runs in
float64]) and an elastic run can be compared with an uninterrupted one to 1e-10. It imports no
shardlab.config: a plugin registers before config builds the `model:` section."""

from __future__ import annotations

import dataclasses

import torch

from shardlab.models import MODELS

_GPT = MODELS["gpt"]
MODELS["gpt64"] = dataclasses.replace(
    _GPT, name="gpt64",
    build=lambda section, seed, vocab: _GPT.build(section, seed, vocab).to(torch.float64),
    rebuild=lambda kwargs, seed: _GPT.rebuild(kwargs, seed).to(torch.float64))
