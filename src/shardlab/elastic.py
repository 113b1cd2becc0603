"""Elastic training: the batch layout at any world size, the node range, the shrink line.

The global batch is the run's contract, not the world size: at N ranks a step still trains on
`train.global_batch_size` samples, the same ones (the sampler's batch of step s is a function
of seed, global batch and s alone: data/sampler.py), so a run that loses or gains a node
continues the same optimization. What changes with N is the layout: each rank runs
k = global / (N x micro) micro batches of `micro` samples.

[Note: the layout rule]
At N ranks the configured micro batch is kept when N x micro divides the global batch. When it
does not, the micro batch is lowered to the largest m <= micro with N x m dividing the global
batch (one printed line says so): a smaller micro batch never needs more memory, a larger one
might not fit. m = 1 works whenever N divides the global batch, so a layout exists exactly at
the world sizes that divide it, and those are what the refusal names. The rule is one function
(`layout_for`): the config check before launch runs it for every world size an elastic launch
may reach, and every (re)start of the workers runs it at the world size it got.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardlab.errors import ConfigError


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


def parse_nnodes(text: str) -> tuple[int, int]:
    """`--nnodes N` or `--nnodes MIN:MAX` -> (MIN, MAX); ConfigError on a bad range."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        raise ConfigError(f"--nnodes {text}: give N or MIN:MAX with whole numbers, e.g. --nnodes 1:2") from None
    if len(parts) > 2 or lo < 1 or hi < lo:
        raise ConfigError(f"--nnodes {text}: needs 1 <= MIN <= MAX (MIN:MAX nodes, e.g. --nnodes 1:2)")
    return lo, hi


def check_node_range(check: Callable[[int], None], nproc: int, lo: int, hi: int) -> None:
    """Run `check(world size)` (config.validate_for_world: the layout rule among its checks) at
    every world size an elastic launch of `nproc` workers per node may reach, before any worker
    starts; a ConfigError names the first node count that fails."""
    for nodes in range(lo, hi + 1):
        try:
            check(nodes * nproc)
        except ConfigError as e:
            raise ConfigError(f"--nnodes {lo}:{hi} x --nproc {nproc}: at {nodes} node(s), {e}") from None
