"""Which samples each rank reads at each step: DistributedSampler semantics, indexed by step.

Each epoch is a permutation of the dataset (seeded by seed + epoch: the `set_epoch` of
torch's DistributedSampler), cut into floor(n / G) global batches of G samples; the
remainder of each epoch is dropped (drop_last), so no global batch ever holds a sample
twice. Rank r of N takes the r-th contiguous slice of G/N samples of each global batch.
The batch of step s is a pure function of (seed, s), so the data position in the
training state is just the step: resuming at step s reads exactly what an uninterrupted
run would have read.
"""

from __future__ import annotations

import torch


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0, shuffle: bool = True):
        if num_samples < global_batch_size:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than one global batch "
                             f"({global_batch_size}); give more data or lower train.global_batch_size")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.steps_per_epoch = num_samples // global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._perm_epoch: int | None = None
        self._perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                self._perm = torch.randperm(self.num_samples, generator=g)
            else:
                self._perm = torch.arange(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def global_indices(self, step: int) -> torch.Tensor:
        """The G sample indices of step `step`."""
        epoch, k = divmod(step, self.steps_per_epoch)
        return self._permutation(epoch)[k * self.global_batch_size:(k + 1) * self.global_batch_size]

    def rank_indices(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        per_rank = self.global_batch_size // world_size
        return self.global_indices(step)[rank * per_rank:(rank + 1) * per_rank]
