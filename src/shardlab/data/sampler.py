"""Which samples each rank reads at each step: DistributedSampler semantics, indexed by step.

Each epoch is a permutation of the dataset (seeded by seed and epoch: the `set_epoch` of
torch's DistributedSampler), cut into floor(n / G) global batches of G samples; the
remainder of each epoch is dropped (drop_last), so no global batch ever holds a sample
twice. Rank r of N takes the r-th contiguous slice of G/N samples of each global batch.
The batch of step s is a pure function of (seed, s), so the data position in the
training state is just the step: resuming at step s reads exactly what an uninterrupted
run would have read.

[Note: a permutation without a table] `torch.randperm(n)` would hold n int64 per rank and
take O(n) time at each epoch's first step: for a 2 GiB corpus of 128-token samples, 128 MiB
per rank and a second of stall (measured: it was what grew with the corpus in the first data
benchmark). The permutation is instead a keyed bijection computed per index: a balanced Feistel
network on the smallest even number of bits covering n (so its domain is < 4n), with
cycle-walking for values >= n (Black and Rogaway's construction for format-preserving
encryption). A step computes only its G indices: O(G) time and memory whatever n is.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from shardlab.data.shards import DataError

_ROUNDS = 6
_MASK32 = np.uint64(0xFFFFFFFF)
_MUL = (np.uint64(0x7FEB352D), np.uint64(0x846CA68B))


def _mix32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (xor-shift-multiply, "lowbias32"), on uint64 so nothing overflows."""
    x = x ^ (x >> np.uint64(16))
    x = (x * _MUL[0]) & _MASK32
    x = x ^ (x >> np.uint64(15))
    x = (x * _MUL[1]) & _MASK32
    return x ^ (x >> np.uint64(16))


class FeistelPermutation:
    """A pseudo-random permutation of [0, n), keyed by `key`, evaluated index by index."""

    def __init__(self, n: int, key: int):
        self.n = n
        self.half = max(1, ((max(n - 1, 1)).bit_length() + 1) // 2)  # 2 * half bits cover [0, n)
        rng = random.Random(key)
        self.keys = [np.uint64(rng.getrandbits(32)) for _ in range(_ROUNDS)]

    def _once(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        mask = np.uint64((1 << self.half) - 1)
        left, right = x >> half, x & mask
        for k in self.keys:
            left, right = right, left ^ (_mix32(right ^ k) & mask)
        return (left << half) | right

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        # numpy, not torch: a batch is a few dozen indices, where numpy's per-call cost is ~10x lower
        out = self._once(positions.numpy().astype(np.uint64))
        outside = out >= self.n
        while outside.any():  # cycle-walking: a bijection of [0, 4n) restricted to [0, n)
            out[outside] = self._once(out[outside])
            outside = out >= self.n
        return torch.from_numpy(out.astype(np.int64))


def require_one_global_batch(rows: int, global_batch_size: int, where: str = "",
                             fix: str = "give more data or lower train.global_batch_size") -> None:
    """A step trains on one global batch of distinct rows, so data with fewer rows cannot train.
    The sources whose size is known before the workers start call it then (their `prepare`);
    the sampler calls it for the others."""
    if rows < global_batch_size:
        prefix = f"{where}: " if where else ""
        raise DataError(f"{prefix}the training data has {rows} row{'s' * (rows != 1)}, fewer than one global batch "
                        f"(train.global_batch_size={global_batch_size}); {fix}")


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0, shuffle: bool = True):
        require_one_global_batch(num_samples, global_batch_size)
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.steps_per_epoch = num_samples // global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch: int | None = None
        self._perm: FeistelPermutation | None = None

    def _permutation(self, epoch: int) -> FeistelPermutation:
        if self._epoch != epoch:
            self._perm = FeistelPermutation(self.num_samples, self.seed * 100_003 + epoch)
            self._epoch = epoch
        return self._perm

    def global_indices(self, step: int) -> torch.Tensor:
        """The G sample indices of step `step`."""
        epoch, k = divmod(step, self.steps_per_epoch)
        positions = torch.arange(k * self.global_batch_size, (k + 1) * self.global_batch_size, dtype=torch.int64)
        return self._permutation(epoch)(positions) if self.shuffle else positions

    def rank_indices(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        per_rank = self.global_batch_size // world_size
        return self.global_indices(step)[rank * per_rank:(rank + 1) * per_rank]
