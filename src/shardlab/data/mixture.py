"""Weighted mixtures of prepared corpora: `data.source=tokens` with `data.mix={DATA_DIR: weight, ...}`
(Megatron's blended datasets are the reference design). `MixtureWindows` is the corpora's
windows side by side as one dataset; `MixtureSampler` decides, for every step, how many samples
each corpus gives and which ones, as a pure function of (seed, weights, step).

[Note: mixture order] The samples of step s are the global sample indices [sG, (s+1)G). How many
of the first n come from each corpus is a closed form, `apportion(n, weights)`: corpus 1 gets
round(w1 n), corpus 2 gets round(w2 / (1 - w1) x what is left), and so on down the list (exact
rational arithmetic, rounding half up); the last gets the rest. Each count is a nondecreasing
function of n (a rounded share of a nondecreasing remainder that grows by at most 1 when n does),
so step s's share of corpus j is apportion((s+1)G)[j] - apportion(sG)[j] >= 0, computed in O(J)
with no table, and corpus j's count after any whole number of steps is within J/2 samples of
w_j n (two corpora: within 1/2). Megatron's greedy rule ("the most under-served corpus takes the
next sample") has the same bound but needs the counts so far, i.e. a table or a replay of the
run; the closed form needs neither, and it also gives the exact per-corpus counts of any range of
steps (what the run summary reports) without counting anything.

Within a corpus, its samples are taken in the order of its own step-independent stream: position
p of corpus j is sample Feistel_{seed, j, p // n_j}(p mod n_j) (the keyed permutation of
loader.py, a new one each epoch of that corpus), so a small corpus repeats (a new epoch) while a
large one is still in its first. The G samples of a step are then shuffled by a permutation keyed
by (seed, step), so each rank's slice holds the corpora in proportion on average. Nothing depends
on the world size: rank r of N takes the r-th slice of the same G indices, as with
GlobalBatchSampler, so resume and resume at another world size read what an uninterrupted run
reads. One difference from GlobalBatchSampler: where a step crosses a corpus's epoch boundary, a
window of that corpus can occur twice in that step's batch (once from each epoch), as in
Megatron's blend; every start check requires each corpus to hold at least one global batch of
windows, so at most one boundary per corpus falls in any step.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import os
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from shardlab.data.loader import FeistelPermutation
from shardlab.errors import ConfigError


def check_mix_weights(mix: Any) -> None:
    """data.mix's shape, before any worker starts: a non-empty mapping of paths to positive weights."""
    example = "e.g. data.mix={/data/web: 0.7, /data/code: 0.3}"
    if not isinstance(mix, Mapping) or not mix:
        raise ConfigError(f"data.mix is empty: give a mapping of prepared corpus directories to weights, {example}")
    for path, w in mix.items():
        if not isinstance(path, str) or not path:
            raise ConfigError(f"data.mix: key {path!r} is not a path; keys are prepared corpus directories, {example}")
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"data.mix[{path}]: weight {w!r} must be a number > 0 (weights are normalised to sum "
                              "to 1; leave a corpus out rather than give it 0)")


def normalised_weights(mix: Mapping[str, float]) -> list[Fraction]:
    """data.mix's weights as exact fractions summing to 1, in the mapping's order: a weight is
    taken as the decimal it is written as (0.3 is 3/10, not the nearest binary float), and the
    apportionment is rational arithmetic, so no float rounding enters the order."""
    raw = [Fraction(repr(w)) if isinstance(w, float) else Fraction(w) for w in mix.values()]
    total = sum(raw)
    return [w / total for w in raw]


def apportion(n: int, weights: list[Fraction]) -> list[int]:
    """How many of the first n global samples each corpus gives ([Note: mixture order])."""
    counts, left, rest = [], n, Fraction(1)
    for w in weights[:-1]:
        share = w / rest                                   # of what is left, in [0, 1]
        c = (2 * share.numerator * left + share.denominator) // (2 * share.denominator)  # round half up
        counts.append(c)
        left, rest = left - c, rest - w
    return counts + [left]


def source_names(paths: list[str]) -> list[str]:
    """Short names of a mixture's corpora, as reports and metric keys (`val_loss/<name>`) call
    them: each directory's last path component, with as many of its parents as make them distinct."""
    parts = [os.path.normpath(os.path.abspath(p)).split(os.sep) for p in paths]
    for k in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-k:]).strip("/") for p in parts]
        if len(set(names)) == len(names):
            return names
    return list(paths)


def _key(*parts: Any) -> int:
    """A permutation key from named parts (stable across processes and Python versions)."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


class MixtureWindows(torch.utils.data.Dataset):
    """Several corpora's windows as one dataset: corpus j's window k is index offsets[j] + k;
    `names`: the corpora's (source_names), by which evaluation reports each one's loss."""

    def __init__(self, parts: list[torch.utils.data.Dataset], names: list[str]):
        self.parts, self.names = parts, names
        self.offsets = [0]
        for p in parts:
            self.offsets.append(self.offsets[-1] + len(p))

    def __len__(self) -> int:
        return self.offsets[-1]

    def source_of(self, i: int) -> int:
        return bisect.bisect_right(self.offsets, int(i)) - 1

    def __getitem__(self, i: int):
        j = self.source_of(i)
        return self.parts[j][int(i) - self.offsets[j]]

    def will_need(self, indices: list[int]) -> None:
        for i in indices:
            j = self.source_of(i)
            if hasattr(self.parts[j], "will_need"):
                self.parts[j].will_need([int(i) - self.offsets[j]])


class MixtureSampler:
    """GlobalBatchSampler's interface (global_indices, rank_indices, global_batch_size) over a
    MixtureWindows: step s's G indices are a pure function of (seed, weights, s)."""

    def __init__(self, sizes: list[int], weights: list[Fraction], global_batch_size: int, seed: int = 0,
                 shuffle: bool = True, names: list[str] | None = None):
        if len(sizes) != len(weights) or not sizes or min(sizes) < 1:
            raise ValueError(f"a mixture needs one weight per corpus and at least one window in each, got sizes "
                             f"{sizes} for {len(weights)} weights")
        self.sizes, self.weights = list(sizes), list(weights)
        self.names = list(names) if names is not None else [str(j) for j in range(len(sizes))]  # what reports call them
        self.offsets = np.cumsum([0] + self.sizes[:-1]).tolist()
        self.global_batch_size, self.seed, self.shuffle = global_batch_size, seed, shuffle
        self._perms: dict[int, tuple[int, FeistelPermutation]] = {}  # corpus -> (epoch, permutation): the last one
        self._recent: dict[int, torch.Tensor] = {}  # step -> its indices, for at most two steps

    def samples_before(self, step: int) -> list[int]:
        """Samples each corpus gave in steps [0, step)."""
        return apportion(step * self.global_batch_size, self.weights)

    def step_counts(self, step: int) -> list[int]:
        """Samples each corpus gives in step `step`."""
        return [b - a for a, b in zip(self.samples_before(step), self.samples_before(step + 1))]

    def _permutation(self, j: int, epoch: int) -> FeistelPermutation:
        held = self._perms.get(j)
        if held is None or held[0] != epoch:
            held = (epoch, FeistelPermutation(self.sizes[j], _key("mix", self.seed, j, epoch)))
            self._perms[j] = held
        return held[1]

    def _positions(self, j: int, first: int, count: int) -> torch.Tensor:
        """Corpus j's samples at positions [first, first + count) of its own stream, as dataset indices."""
        pos = torch.arange(first, first + count, dtype=torch.int64)
        if not self.shuffle:
            return self.offsets[j] + pos % self.sizes[j]
        epochs = pos // self.sizes[j]
        out = torch.empty_like(pos)
        for e in torch.unique(epochs).tolist():  # at most two: a corpus holds >= one global batch
            at = epochs == e
            out[at] = self._permutation(j, e)(pos[at] - e * self.sizes[j])
        return self.offsets[j] + out

    def global_indices(self, step: int) -> torch.Tensor:
        """The G dataset indices of step `step`. The loader asks for each step twice (read ahead,
        then read), so the last two steps are kept."""
        if step not in self._recent:
            self._recent = {s: v for s, v in self._recent.items() if s in (step - 1, step + 1)}
            self._recent[step] = self._compute(step)
        return self._recent[step]

    def _compute(self, step: int) -> torch.Tensor:
        before, after = self.samples_before(step), self.samples_before(step + 1)
        parts = [self._positions(j, a, b - a) for j, (a, b) in enumerate(zip(before, after)) if b > a]
        idx = torch.cat(parts)
        if self.shuffle:  # mix the corpora over the step's slots (and so over the ranks)
            idx = idx[FeistelPermutation(len(idx), _key("mix-slots", self.seed, step))(torch.arange(len(idx)))]
        return idx

    def rank_indices(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        per_rank = self.global_batch_size // world_size
        return self.global_indices(step)[rank * per_rank:(rank + 1) * per_rank]


def source_counts(sampler: MixtureSampler, first_step: int, end_step: int, tokens_per_sample: int) -> list[dict[str, Any]]:
    """Per corpus: its weight, and the samples and tokens it gave over the whole run (steps
    [0, end_step)) and over this process's steps [first_step, end_step); exact (the closed form
    of [Note: mixture order], whatever was resumed)."""
    whole, before = sampler.samples_before(end_step), sampler.samples_before(first_step)
    total = max(1, sum(whole))
    return [{"name": short, "data_dir": name, "weight": float(w), "samples": s, "tokens": s * tokens_per_sample,
             "share": s / total, "samples_this_run": s - b, "tokens_this_run": (s - b) * tokens_per_sample}
            for short, name, w, s, b in zip(source_names(sampler.names), sampler.names, sampler.weights, whole,
                                            before)]
