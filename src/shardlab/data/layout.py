"""The batch layout at any world size: how the global batch splits over the ranks.

The global batch is the run's contract, not the world size: at N ranks a step still trains on
`train.global_batch_size` samples, the same ones (the sampler's batch of step s is a function
of seed, global batch and s alone: data/sampler.py), so a run at another world size (an elastic
job that lost or gained a node: loop/elastic.py) continues the same optimization. What changes
with N is the layout: each rank runs k = global / (N x micro) micro batches of `micro` samples.

[Note: the layout rule]
At N ranks the configured micro batch is kept when N x micro divides the global batch. When it
does not, the micro batch is lowered to the largest m <= micro with N x m dividing the global
batch (one printed line says so): a smaller micro batch never needs more memory, a larger one
might not fit. m = 1 works whenever N divides the global batch, so a layout exists exactly at
the world sizes that divide it, and those are what the refusal names. The rule is one function
(`layout_for`): the config check before launch (config.validate_for_world) runs it, for every
world size an elastic launch may reach, and every (re)start of the workers runs it at the world
size it got (loop/run.py's build_run).
"""

from __future__ import annotations

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
