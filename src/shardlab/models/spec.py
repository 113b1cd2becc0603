"""What a model brings to the registry (`shardlab.models.MODELS`): its own `model.*` config
keys, how to build it, and how to rebuild it from a checkpoint without the training data.

Adding a model is one file that defines the module, a keys dataclass and a `ModelSpec`,
plus one line in `MODELS` (docs/architecture.md walks through an example). The config's
`model:` section is the union of every model's keys (config.py builds it from the
registry), so YAML keys stay flat: `model.preset`, `model.resnet_width`, `model.mlp_sizes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

# What a model consumes, which decides the data sources it accepts and the synthetic data
# it gets: "tokens" (causal LM on token windows), "images" (3x32x32, class labels),
# "vectors" (feature vectors, class labels).
DATA_KINDS = ("tokens", "images", "vectors")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    keys: type                                    # dataclass: this model's keys under `model:`
    data_kind: str                                # one of DATA_KINDS
    # (model section, seed, vocab size the data offers or None) -> module, built on the current
    # default device (callers use `with torch.device("meta")` for sharded engines).
    build: Callable[[Any, int, int | None], nn.Module]
    # module -> JSON kwargs that `rebuild` turns back into the same architecture
    record: Callable[[nn.Module], dict[str, Any]]
    rebuild: Callable[[dict[str, Any], int], nn.Module]
    # model section -> None, or raise shardlab.errors.ConfigError naming the key and the fix
    check: Callable[[Any], None] = lambda section: None
    # model section -> what the synthetic data source needs (vocab_size, in_features, num_classes)
    synthetic: Callable[[Any], dict[str, Any]] = lambda section: {}
    # the longest input it takes (token models), for the data.seq_len check; None = no limit
    max_seq_len: Callable[[Any], int | None] = lambda section: None
