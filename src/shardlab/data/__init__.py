"""Data sources behind `data.source`: tokens (a directory `shardlab prepare` wrote), builtin
(the embedded corpus), text, sft, cifar10, synthetic.

`build_datasets(cfg)` returns the train and validation datasets and what the model needs
to know about them (vocab size); `GlobalBatchSampler` decides which samples each rank
reads at each step (disjoint slices of one global batch); `StepBatches` (loader.py) delivers
them through torch's DataLoader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shardlab.data.sampler import GlobalBatchSampler

__all__ = ["GlobalBatchSampler", "Datasets", "DATA_SOURCES", "PREPARED_SOURCES", "build_datasets", "collate"]

# data.source -> what it yields (a ModelSpec.data_kind); None: whatever the model takes.
DATA_SOURCES: dict[str, str | None] = {"builtin": "tokens", "text": "tokens", "tokens": "tokens", "sft": "tokens",
                                       "cifar10": "images", "synthetic": None}
# the sources that train on prepared token shards (data/tokens.py): checked before workers start
PREPARED_SOURCES = ("builtin", "text", "tokens")


@dataclass
class Datasets:
    train: torch.utils.data.Dataset
    val: torch.utils.data.Dataset | None
    vocab_size: int | None = None       # text sources
    tokens_per_sample: int | None = None
    info: dict[str, Any] | None = None  # goes to run_args.json (e.g. corpus hash)
    tokenizer_dir: str | None = None    # sft: the tokenizer used (exports copy it)
    # sft: non-padding tokens of each training sample (tokens_processed counts these, not padding)
    real_tokens: torch.Tensor | None = None
    # what happened to the data (examples read, dropped, truncated, rows, target tokens, warnings):
    # rank 0 prints these lines at the start of a run
    report: list[str] = field(default_factory=list)
    # prepared sources: the SHA-256 of the corpus's manifest.json (a resume refuses another)
    manifest_sha256: str | None = None


def build_datasets(cfg) -> Datasets:
    d, m = cfg.data, cfg.model
    if d.source in PREPARED_SOURCES:
        from shardlab.data import tokens

        return tokens.build(cfg)
    if d.source == "sft":
        from shardlab.data import sft

        return sft.build(cfg)
    if d.source == "cifar10":
        from shardlab.data.cifar import CIFAR10, find_cifar_dir

        folder = find_cifar_dir(d.path)
        train = CIFAR10(folder, train=True)
        try:
            val = CIFAR10(folder, train=False)
        except FileNotFoundError:
            val = None
        return Datasets(train, val, info={"cifar10": folder, "train_samples": len(train)})
    if d.source == "synthetic":
        from shardlab.data.synthetic import SyntheticDataset
        from shardlab.models import model_spec

        spec = model_spec(m.name)  # synthetic data shaped for the model: its kind and sizes
        kind, kw = spec.data_kind, {"seq_len": d.seq_len, **spec.synthetic(m)}
        train = SyntheticDataset(kind, d.synthetic_samples, cfg.seed, **kw)
        val = SyntheticDataset(kind, max(64, d.synthetic_samples // 20), cfg.seed + 7919, **kw)
        return Datasets(train, val, vocab_size=kw.get("vocab_size") if kind == "tokens" else None,
                        tokens_per_sample=d.seq_len if kind == "tokens" else None, info={"synthetic": kind})
    raise ValueError(d.source)


def collate(dataset: torch.utils.data.Dataset, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(dataset[int(i)] for i in indices))
    return torch.stack(xs), torch.stack(ys)
