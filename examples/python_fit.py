"""Your own model, data and loss, trained by shardlab's loop (docs/python.md, "2. shardlab's loop").

    python -m shardlab.torchrun --nproc-per-node 2 examples/python_fit.py [key=value ...]

Every engine (parallel.strategy), accumulation, mixed precision, sharded checkpoints that resume
at another world size, preemption, the report and the doctor come with it. The registrations
sit at module level and the training under `__main__`, so `shardlab verify` (and the CLI) can
import this file for its model and data: SHARDLAB_PLUGINS=python_fit with examples/ on PYTHONPATH.
"""

import torch
import torch.nn.functional as F
from torch import nn

import shardlab


class Regressor(nn.Module):
    """A small residual MLP of your own: any nn.Module whose forward takes the inputs."""

    def __init__(self, features: int = 8, width: int = 32, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(features, width, dtype=torch.float64)
        self.blocks = nn.ModuleList(nn.Linear(width, width, dtype=torch.float64) for _ in range(depth))
        self.out = nn.Linear(width, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h).squeeze(-1)


class NoisyPlane(torch.utils.data.Dataset):
    """Your own map-style dataset: item i is a pure function of i (any Dataset works; this one
    needs no file). Targets: a fixed plane of the inputs, plus noise."""

    def __init__(self, samples: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(samples, 8, generator=g, dtype=torch.float64)
        self.y = self.x @ torch.linspace(-1, 1, 8, dtype=torch.float64) + 0.1 * torch.randn(
            samples, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


@shardlab.register_model("regressor", loss=F.mse_loss)
def build_regressor() -> nn.Module:
    return Regressor()


@shardlab.register_data("noisy-plane")
def noisy_plane(cfg) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    return NoisyPlane(512, cfg.seed), NoisyPlane(64, cfg.seed + 1)


CONFIG = {
    "model": {"name": "regressor"},
    "data": {"source": "noisy-plane"},
    "train": {"steps": 6, "global_batch_size": 12, "micro_batch_size": 2, "lr": 0.01, "warmup_steps": 0},
    "parallel": {"strategy": "fsdp"},
    "checkpoint": {"every_steps": 2},
    "output": {"dir": "runs", "run_name": "python-fit"},
}

if __name__ == "__main__":
    import sys

    result = shardlab.fit(CONFIG, sys.argv[1:])  # command-line key=value overrides, as `shardlab train`
    raise SystemExit(result.exit_code)            # 75 after a preemption save: the same command resumes
