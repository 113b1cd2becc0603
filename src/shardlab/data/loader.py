"""Micro batches through torch's DataLoader, in the order the step-indexed sampler dictates.

`StepBatches.next(step)` returns this rank's next micro batch of step `step`. Behind it a
DataLoader reads the micro batches of steps [step, end) with `data.num_workers` worker
processes (null: 2 on CUDA, none on CPU), pinned memory and prefetching on CUDA, so the next
batches are read while the model computes. The order is still the pure function of (seed,
step) that `GlobalBatchSampler` defines: a resumed run, or one at another world size, reads
what an uninterrupted run would. When the caller asks for a step the loader did not expect
(a resume, a test driving steps by hand), it starts a new DataLoader at that step.

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

import time
from collections.abc import Iterator

import torch

from shardlab.data.sampler import GlobalBatchSampler


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
