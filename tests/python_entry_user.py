"""A user's own training script, for tests/test_python_entry.py: a model and a dataset that are
not in the catalogue, registered through shardlab's Python entry and trained by `shardlab.fit`.
Its loss is inside the model (forward(inputs, targets) returns it); examples/python_fit.py shows
the other way, `register_model(..., loss=...)`.

    python -m shardlab.torchrun --nproc-per-node 2 tests/python_entry_user.py output.dir=DIR ...

STALL_AFTER=K (a test's switch, not a user's): once this process has read K training samples,
reading another blocks, so a run sits at a known step boundary, its checkpoint written, until the
test kills it.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import shardlab


class Classifier(nn.Module):
    """Float64 throughout, so a resume at another world size equals the uninterrupted run to rounding."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, dtype=torch.float64) for a, b in ((6, 24), (24, 24)))
        self.head = nn.Linear(24, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        logits = self.head(x)
        return logits if targets is None else F.cross_entropy(logits, targets)


class Clusters(torch.utils.data.Dataset):
    """Three Gaussian clusters; item i a pure function of (seed, i)."""

    def __init__(self, samples: int, seed: int, stall_after: int | None = None):
        self.samples, self.seed, self.stall_after, self.read = samples, seed, stall_after, 0

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read += 1
        while self.stall_after is not None and self.read > self.stall_after:
            time.sleep(1)  # until the test kills this process
        g = torch.Generator().manual_seed(self.seed * 100_003 + int(i))
        label = int(i) % 3
        return torch.randn(6, generator=g, dtype=torch.float64) + 2.0 * label, torch.tensor(label)


@shardlab.register_model("user-classifier")
def build() -> nn.Module:
    return Classifier()


@shardlab.register_data("user-clusters")
def clusters(cfg):
    stall = os.environ.get("STALL_AFTER")
    return Clusters(240, cfg.seed, int(stall) if stall else None), Clusters(24, cfg.seed + 1)


CONFIG = {"model.name": "user-classifier", "data.source": "user-clusters", "parallel.strategy": "zero3",
          "train": {"steps": 6, "global_batch_size": 12, "micro_batch_size": 2, "lr": 0.05, "warmup_steps": 1},
          "checkpoint.every_steps": 2, "output": {"progress": False, "tensorboard": False}}

if __name__ == "__main__":
    raise SystemExit(shardlab.fit(CONFIG, sys.argv[1:]).exit_code)
