"""Data sources behind `data.source`, one module each, each bringing a `DataSource`
(data/source.py): tokens.py (tokens, a directory `shardlab prepare` wrote; builtin, the embedded
corpus; text, your files: both prepared into the cache), sft.py, cifar.py, synthetic.py.

`build_datasets(cfg)` returns the train and validation datasets and what the model needs
to know about them (vocab size); `GlobalBatchSampler` decides which samples each rank
reads at each step (disjoint slices of one global batch); `StepBatches` (loader.py) delivers
them through torch's DataLoader.
"""

from __future__ import annotations

import torch

from shardlab.data import cifar, sft, synthetic, tokens
from shardlab.data.datasets import Datasets
from shardlab.data.loader import GlobalBatchSampler
from shardlab.data.source import DataSource

__all__ = ["GlobalBatchSampler", "Datasets", "DataSource", "DATA_SOURCES", "PREPARED_SOURCES", "data_source",
           "build_datasets", "prepare_datasets", "make_sampler", "collate"]

# data.source -> its DataSource (data/source.py). The order is the order help texts list them in.
DATA_SOURCES: dict[str, DataSource] = {s.name: s for s in (tokens.BUILTIN, tokens.TEXT, tokens.TOKENS, sft.SOURCE,
                                                            cifar.SOURCE, synthetic.SOURCE)}
# the sources that train on a corpus in `shardlab prepare`'s format (DataSource.prepared)
PREPARED_SOURCES = tuple(name for name, s in DATA_SOURCES.items() if s.prepared)


def data_source(name: str) -> DataSource:
    if name not in DATA_SOURCES:
        raise ValueError(f"unknown data source {name!r}; valid: {', '.join(DATA_SOURCES)}")
    return DATA_SOURCES[name]


def build_datasets(cfg) -> Datasets:
    return data_source(cfg.data.source).build(cfg)


def prepare_datasets(cfg) -> None:
    """Work every worker would repeat (preparing the embedded corpus or text into the cache,
    hashing shards new to this machine, tokenizing SFT data) and the checks that need the data,
    done once before they start (`shardlab train`, `shardlab verify`): the source's `prepare`."""
    data_source(cfg.data.source).prepare(cfg)


def make_sampler(data: Datasets, global_batch_size: int, seed: int, shuffle: bool):
    """The step-indexed sampler over data.train: the source's own (a mixture's) or GlobalBatchSampler."""
    if data.make_sampler is not None:
        return data.make_sampler(global_batch_size, seed, shuffle)
    return GlobalBatchSampler(len(data.train), global_batch_size, seed, shuffle)


def collate(dataset: torch.utils.data.Dataset, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(dataset[int(i)] for i in indices))
    return torch.stack(xs), torch.stack(ys)
