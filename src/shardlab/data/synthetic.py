"""Synthetic data for benchmarks: every sample is a pure function of (seed, index)."""

from __future__ import annotations

import torch

from shardlab.data.datasets import Datasets
from shardlab.data.loader import require_one_global_batch
from shardlab.data.source import DataSource
from shardlab.models import model_spec


class SyntheticDataset(torch.utils.data.Dataset):
    """kind="tokens": (seq_len tokens, next tokens); "images": (3x32x32, label); "vectors": (d, label)."""

    def __init__(self, kind: str, num_samples: int, seed: int = 0, *, seq_len: int = 128, vocab_size: int = 256,
                 in_features: int = 32, num_classes: int = 10):
        self.kind, self.n, self.seed = kind, num_samples, seed
        self.seq_len, self.vocab_size, self.in_features, self.num_classes = seq_len, vocab_size, in_features, num_classes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        if self.kind == "tokens":
            x = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)
            return x[:-1], x[1:]
        if self.kind == "images":
            return torch.randn(3, 32, 32, generator=g), torch.randint(0, self.num_classes, (), generator=g)
        if self.kind == "vectors":
            x = torch.randn(self.in_features, generator=g)
            return x, (x[: self.num_classes].argmax() if self.in_features >= self.num_classes
                       else torch.randint(0, self.num_classes, (), generator=g))
        raise ValueError(f"unknown synthetic kind {self.kind!r}")


# -- the source (shardlab.data.DATA_SOURCES) ---------------------------------------------------------
def _build(cfg) -> Datasets:
    """Synthetic data shaped for the model: its kind and sizes."""
    d, m = cfg.data, cfg.model
    spec = model_spec(m.name)
    kind, kw = spec.data_kind, {"seq_len": d.seq_len, **spec.synthetic(m)}
    train = SyntheticDataset(kind, d.synthetic_samples, cfg.seed, **kw)
    val = SyntheticDataset(kind, max(64, d.synthetic_samples // 20), cfg.seed + 7919, **kw)
    return Datasets(train, val, vocab_size=kw.get("vocab_size") if kind == "tokens" else None,
                    tokens_per_sample=d.seq_len if kind == "tokens" else None, info={"synthetic": kind})


def _prepare(cfg) -> None:
    """Nothing to prepare; the size check, before any worker starts."""
    require_one_global_batch(cfg.data.synthetic_samples, cfg.train.global_batch_size, "data.source=synthetic",
                             "raise data.synthetic_samples or lower train.global_batch_size")


SOURCE = DataSource(name="synthetic", kind=None, build=_build, prepare=_prepare)
