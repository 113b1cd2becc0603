"""How a rank's batches are cut, step by step: the batch layout at any world size, the
step-indexed sampler (which samples a step trains on), and the loader that reads this rank's
micro batches of them through torch's DataLoader. Three pieces of one rule: the global batch
of step s is a pure function of (seed, s), whatever the world size, and the layout only says
how it splits over the ranks.

The layout. The global batch is the run's contract, not the world size: at N ranks a step still
trains on `train.global_batch_size` samples, the same ones, so a run at another world size (an
elastic job that lost or gained a node: loop/elastic.py) continues the same optimization. What
changes with N is the layout: each rank runs k = global / (N x micro) micro batches of `micro`
samples.

[Note: the layout rule]
At N ranks the configured micro batch is kept when N x micro divides the global batch. When it
does not, the micro batch is lowered to the largest m <= micro with N x m dividing the global
batch (one printed line says so): a smaller micro batch never needs more memory, a larger one
might not fit. m = 1 works whenever N divides the global batch, so a layout exists exactly at
the world sizes that divide it, and those are what the refusal names. The rule is one function
(`layout_for`): the config check before launch (config.validate_for_world) runs it, for every
world size an elastic launch may reach, and every (re)start of the workers runs it at the world
size it got (loop/run.py's build_run).

The sampler: which samples each rank reads at each step, DistributedSampler semantics indexed by
step. Each epoch is a permutation of the dataset (seeded by seed and epoch: the `set_epoch` of
torch's DistributedSampler), cut into floor(n / G) global batches of G samples; the remainder of
each epoch is dropped (drop_last), so no global batch ever holds a sample twice. Rank r of N
takes the r-th contiguous slice of G/N samples of each global batch. The batch of step s is a
pure function of (seed, s), so the data position in the training state is just the step:
resuming at step s reads exactly what an uninterrupted run would have read.

[Note: a permutation without a table] `torch.randperm(n)` would hold n int64 per rank and
take O(n) time at each epoch's first step: for a 2 GiB corpus of 128-token samples, 128 MiB
per rank and a second of stall (measured: it was what grew with the corpus in the first data
benchmark). The permutation is instead a keyed bijection computed per index: a balanced Feistel
network on the smallest even number of bits covering n (so its domain is < 4n), with
cycle-walking for values >= n (Black and Rogaway's construction for format-preserving
encryption). A step computes only its G indices: O(G) time and memory whatever n is.

The loader: `StepBatches.next(step)` returns this rank's next micro batch of step `step`. Behind
it a DataLoader reads the micro batches of steps [step, end) with `data.num_workers` worker
processes (null: 2 on CUDA, none on CPU), pinned memory and prefetching on CUDA, so the next
batches are read while the model computes, in the order `GlobalBatchSampler` dictates. When the
caller asks for a step the loader did not expect (a resume, a test driving steps by hand), it
starts a new DataLoader at that step.

[Note: reading ahead] The step-indexed sampler knows every future batch, so when a step starts
the loader asks the dataset to have the next step's samples read from storage in the
background (prepared shards: madvise MADV_WILLNEED). A corpus larger than the page cache, or
one on a network filesystem, then loads while the current step computes instead of stalling
the next step's page faults (measured in docs/data.md).

[Note: why no workers on CPU] On CPU the ranks already use every core, and one micro batch
of gpt-tiny is 4 windows of 129 tokens copied out of a memory map (tens of microseconds);
a worker process would add a process per rank and its memory to save nothing. Measured in
docs/data.md: data waits are well under 2 % of the step either way.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from shardlab.data.shards import DataError
from shardlab.errors import ConfigError


# -- the layout: the global batch over the ranks ---------------------------------------------------
@dataclass(frozen=True)
class Layout:
    world_size: int
    micro: int            # samples per micro batch on each rank
    accumulation: int     # micro batches per rank per step
    configured_micro: int

    @property
    def lowered(self) -> bool:
        return self.micro != self.configured_micro

    def note(self, global_batch: int) -> str | None:
        """The one line a lowered micro batch is announced with (None when it was kept)."""
        if not self.lowered:
            return None
        return (f"shardlab: at world size {self.world_size}, train.micro_batch_size={self.configured_micro} does not "
                f"divide train.global_batch_size={global_batch} over the ranks; micro batch {self.micro} x "
                f"{self.accumulation} accumulation instead (the global batch is kept)")


def working_sizes(global_batch: int, limit: int = 64) -> list[int]:
    """The world sizes with a layout (those dividing the global batch), up to `limit`."""
    return [n for n in range(1, min(global_batch, limit) + 1) if global_batch % n == 0]


def layout_for(global_batch: int, micro: int, world_size: int) -> Layout:
    """See [Note: the layout rule]; ConfigError when no layout exists at `world_size`."""
    if world_size < 1:
        raise ConfigError(f"the number of workers must be >= 1, got {world_size}")
    if global_batch % world_size:
        raise ConfigError(
            f"train.global_batch_size={global_batch} has no layout at world size {world_size}: it must divide "
            f"evenly over the ranks; world sizes that work: {', '.join(map(str, working_sizes(global_batch)))} "
            f"(or set train.global_batch_size to a multiple of {world_size})")
    per_rank = global_batch // world_size
    m = next(m for m in range(min(micro, per_rank), 0, -1) if per_rank % m == 0)
    return Layout(world_size, m, per_rank // m, micro)


# -- the sampler: which samples a step trains on ---------------------------------------------------
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


# -- the loader: this rank's micro batches through torch's DataLoader ------------------------------
class StepBatchSampler(torch.utils.data.Sampler[list[int]]):
    """This rank's micro batches (index lists) of steps [start, end), in training order."""

    def __init__(self, sampler: GlobalBatchSampler, rank: int, world_size: int, micro_batch_size: int,
                 start: int, end: int):
        self.sampler, self.rank, self.world_size = sampler, rank, world_size
        self.micro, self.start, self.end = micro_batch_size, start, end
        self.per_step = sampler.global_batch_size // world_size // micro_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.end):
            idx = self.sampler.rank_indices(step, self.rank, self.world_size).tolist()
            for i in range(0, len(idx), self.micro):
                yield idx[i:i + self.micro]

    def __len__(self) -> int:
        return max(0, self.end - self.start) * self.per_step


class StepBatches:
    """The training loop's source of micro batches; also times how long it waits for them."""

    def __init__(self, dataset, sampler: GlobalBatchSampler, rank: int, world_size: int, micro_batch_size: int,
                 end_step: int, device: torch.device, num_workers: int | None = None):
        self.dataset, self.sampler, self.rank, self.world_size = dataset, sampler, rank, world_size
        self.micro, self.end_step, self.device = micro_batch_size, end_step, device
        self.num_workers = num_workers if num_workers is not None else (2 if device.type == "cuda" else 0)
        self.per_step = sampler.global_batch_size // world_size // micro_batch_size
        self._it: Iterator | None = None
        self._at: tuple[int, int] | None = None  # (step, micro batch) the iterator yields next
        self.wait_s: dict[int, float] = {}       # step -> seconds spent waiting for its batches

    def _start(self, step: int) -> None:
        self._it = None  # an abandoned loader's workers shut down with it
        loader = torch.utils.data.DataLoader(
            self.dataset, num_workers=self.num_workers, pin_memory=self.device.type == "cuda",
            batch_sampler=StepBatchSampler(self.sampler, self.rank, self.world_size, self.micro, step,
                                           max(step + 1, self.end_step)),
            prefetch_factor=4 if self.num_workers else None, persistent_workers=False,
            # its own generator: starting an iterator draws a seed, which must not come from the
            # global RNG (a resume restores that RNG, then starts a loader: dropout would differ)
            generator=torch.Generator().manual_seed(step))
        self._it = iter(loader)
        self._at = (step, 0)

    def next(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro batch of step `step` (the first one when the step starts)."""
        t0 = time.perf_counter()
        if self._at is None or self._at[0] != step:
            self._start(step)
        if self._at[1] == 0 and hasattr(self.dataset, "will_need"):  # see [Note: reading ahead]
            self.dataset.will_need(self.sampler.rank_indices(step + 1, self.rank, self.world_size).tolist())
        x, y = next(self._it)
        k = self._at[1] + 1
        self._at = (step + 1, 0) if k == self.per_step else (step, k)
        self.wait_s[step] = self.wait_s.get(step, 0.0) + time.perf_counter() - t0
        return x, y
