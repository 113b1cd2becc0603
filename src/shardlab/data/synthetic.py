"""Synthetic data for benchmarks: every sample is a pure function of (seed, index)."""

from __future__ import annotations

import torch


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
