"""How a rank's state is copied for a save: `StageCopy` (the checkpoint manager's copy; for
`checkpoint.async=true` a staged one). What each save costs is measured by the loop
(loop/run.py's `CheckpointCost`)."""

from __future__ import annotations

import torch


class StageCopy:
    """How the checkpoint manager copies what a rank saves. Staged (an asynchronous save, so
    training may modify the live tensors while the background write runs): on CUDA into pinned
    host memory, non-blocking, with one synchronize in `done`, so the write never touches the
    GPU and the copy runs at PCIe speed; elsewhere a clone. Not staged: the tensors themselves."""

    def __init__(self, device: torch.device, stage: bool):
        self.stage, self.cuda = stage, stage and device.type == "cuda"
        self.device = device

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if not self.stage:
            return t.detach()
        if not self.cuda:
            return t.detach().clone()
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.detach(), non_blocking=True)

    def done(self) -> None:
        """After the last copy: wait until the pinned copies landed."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
