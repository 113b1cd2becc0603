"""Which samples each rank reads at each step: DistributedSampler semantics, indexed by step.

A global batch of G samples per step is drawn from a per-epoch permutation (seeded by
seed + epoch, the `set_epoch` of torch's DistributedSampler); rank r of N takes the r-th
contiguous slice of G/N. The batch of step s is a pure function of (seed, s), so the data
position in the training state is just the step: resuming at step s reads exactly what an
uninterrupted run would have read.
"""

from __future__ import annotations

import torch


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0, shuffle: bool = True):
        if num_samples < 1:
            raise ValueError("the dataset is empty")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.clear()
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                self._perms[epoch] = torch.randperm(self.num_samples, generator=g)
            else:
                self._perms[epoch] = torch.arange(self.num_samples)
        return self._perms[epoch]

    def epoch_of(self, step: int) -> int:
        return step * self.global_batch_size // self.num_samples

    def global_indices(self, step: int) -> torch.Tensor:
        """The G sample indices of step `step` (crossing an epoch boundary when needed)."""
        flat = torch.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size)
        epochs, pos = flat // self.num_samples, flat % self.num_samples
        return torch.stack([self._perm(int(e))[int(p)] for e, p in zip(epochs, pos)])

    def rank_indices(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        per_rank = self.global_batch_size // world_size
        return self.global_indices(step)[rank * per_rank:(rank + 1) * per_rank]
