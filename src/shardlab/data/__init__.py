"""Data sources behind `data.source`, one module each (text.py: builtin, the embedded corpus, and
text; sft.py; cifar.py; synthetic.py), each bringing a `DataSource` (data/source.py).

`build_datasets(cfg)` returns the train and validation datasets and what the model needs
to know about them (vocab size); `GlobalBatchSampler` decides which samples each rank
reads at each step (disjoint slices of one global batch).
"""

from __future__ import annotations

import torch

from shardlab.data import cifar, sft, synthetic, text
from shardlab.data.datasets import Datasets
from shardlab.data.sampler import GlobalBatchSampler
from shardlab.data.source import DataSource

__all__ = ["GlobalBatchSampler", "Datasets", "DataSource", "DATA_SOURCES", "data_source", "build_datasets", "collate"]

# data.source -> its DataSource (data/source.py). The order is the order help texts list them in.
DATA_SOURCES: dict[str, DataSource] = {s.name: s for s in (text.BUILTIN, text.TEXT, sft.SOURCE, cifar.SOURCE,
                                                            synthetic.SOURCE)}


def data_source(name: str) -> DataSource:
    if name not in DATA_SOURCES:
        raise ValueError(f"unknown data source {name!r}; valid: {', '.join(DATA_SOURCES)}")
    return DATA_SOURCES[name]


def build_datasets(cfg) -> Datasets:
    return data_source(cfg.data.source).build(cfg)


def collate(dataset: torch.utils.data.Dataset, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(dataset[int(i)] for i in indices))
    return torch.stack(xs), torch.stack(ys)
