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


@dataclass
class NoKeys:
    """The keys of a model that takes none of its own under `model:`."""


# What a model consumes, which decides the data sources it accepts and the synthetic data
# it gets: "tokens" (causal LM on token windows), "images" (3x32x32, class labels),
# "vectors" (feature vectors, class labels).
DATA_KINDS = ("tokens", "images", "vectors")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    data_kind: str                                # one of DATA_KINDS
    keys: type = NoKeys                           # dataclass: this model's keys under `model:`
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
    # model section -> None, or why data.packing=true cannot keep this model's packed examples apart
    packing_problem: Callable[[Any], str | None] = lambda section: None
    # the longest input it takes (token models), for the data.seq_len check; None = no limit
    max_seq_len: Callable[[Any], int | None] = lambda section: None
    # What `shardlab plan` asks (plan/model.py). Its probes run the model cut to a few blocks:
    # depth: model section -> its blocks (GPT's n_layer, an HF decoder's num_hidden_layers),
    # None when it runs whole; cut_depth: (section as a dict, n, a scratch directory) -> None,
    # the section at n blocks, in place.
    depth: Callable[[Any], int | None] = lambda section: None
    cut_depth: Callable[[dict[str, Any], int, str], None] | None = None
    # The model key that fixes its vocabulary (its embedding's rows) when the data does not:
    # plan pins it to what the real data offers, so the probe's synthetic tokens build the same
    # model. None: the model fixes its own (an HF config's vocab_size).
    vocab_key: str | None = None
    # model section -> the vocabulary its pretrained files fix whatever the data offers (a pretrained
    # HF model's); None when no `vocab_size` key fixes one either, the model takes the data's: the
    # data sources check a corpus's token ids against it, naming no model (data/tokens.py)
    own_vocab: Callable[[Any], int | None] = lambda section: None
    # True for a language model whose loss is its output projection's cross-entropy, whole or
    # chunked (train.loss, models/lm_loss.py): its module has `use_loss(mode) -> a line or None`.
    # False: train.loss=chunked is refused; auto and full leave the model as it is.
    loss_head: bool = False

    def tokens_per_sample(self, seq_len: int) -> int:
        """Tokens one sample holds, for FLOP and throughput counts: the sequence for a token
        model, one per image or vector otherwise."""
        return seq_len if self.data_kind == "tokens" else 1
