"""What a data source brings to the registry (`shardlab.data.DATA_SOURCES`): what it yields, how to
build its datasets, the checks on its `data.*` keys, the work done once before the workers start,
and the vocabulary its tokenizer offers.

Adding a source is one file that defines its dataset and a `DataSource`, plus one line in
DATA_SOURCES (docs/architecture.md, "Extending shardlab").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardlab.data.datasets import Datasets


@dataclass(frozen=True, kw_only=True)
class DataSource:
    name: str
    # what it yields (a ModelSpec.data_kind: "tokens", "images", "vectors"), which decides the
    # models it feeds; None: whatever the model takes (synthetic data)
    kind: str | None
    # config -> the train and validation datasets (every worker calls it)
    build: Callable[[Any], Datasets]
    # config -> None, or raise shardlab.errors.ConfigError naming the data.* key and the fix;
    # runs while the config is checked, before any worker starts
    check: Callable[[Any], None] = lambda cfg: None
    # config -> (result unused): work every worker would repeat (tokenizing, hashing) and the checks that
    # need the data itself, done once before they start (`shardlab train`); raises ValueError
    # (the message names the file or key and the fix)
    prepare: Callable[[Any], Any] = lambda cfg: None
    # config -> the vocabulary its tokenizer offers, without reading the data (`shardlab plan`;
    # a prepared corpus's manifest says it); None: none of its own
    vocab_size: Callable[[Any], int | None] = lambda cfg: None
    # whether data.packing (several examples per row) applies to it
    packing: bool = False
    # whether it trains on a corpus in `shardlab prepare`'s format (memory-mapped token shards and
    # a manifest, data/tokens.py): its Datasets carry the manifest's hash, and a resume refuses
    # another corpus
    prepared: bool = False
