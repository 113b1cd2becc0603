"""A small ResNet for 32x32 images (CIFAR-10): a stem, `len(blocks)` stages of basic blocks,
global pooling and a linear classifier. Depth and width are configurable.

BatchNorm under data parallelism: each rank normalizes with the statistics of its own
micro batch (as PyTorch's DDP does without SyncBatchNorm), so training matches a single
process only when the per-rank batch is the same; the parity tests therefore run the
ResNet in eval-mode BatchNorm (running statistics fixed), where the math is identical.
Running statistics are buffers: engines broadcast them from rank 0 at wrap time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from shardlab.errors import ConfigError
from shardlab.models.init import init_parameters_
from shardlab.models.spec import ModelSpec


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, blocks: tuple[int, ...] = (2, 2, 2), width: int = 16, num_classes: int = 10,
                 in_channels: int = 3, seed: int = 0):
        super().__init__()
        self.init_seed = seed
        self.arch = {"blocks": list(blocks), "width": width, "num_classes": num_classes, "in_channels": in_channels}
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages, c = [], width
        for i, n in enumerate(blocks):
            c_out = width * 2**i
            stage = [BasicBlock(c, c_out, 1 if i == 0 else 2)] + [BasicBlock(c_out, c_out, 1) for _ in range(n - 1)]
            stages.append(nn.Sequential(*stage))
            c = c_out
        self.stages = nn.ModuleList(stages)
        self.fc = nn.Linear(c, num_classes)
        if self.fc.weight.device.type != "meta":
            init_parameters_(self, seed)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return logits if targets is None else F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets)


# -- registry entry (shardlab.models.MODELS) -------------------------------------------------------
@dataclass
class ResNetKeys:
    """`model.*` keys of model.name=resnet."""

    resnet_blocks: list[int] = field(default_factory=lambda: [2, 2, 2])  # BasicBlocks per stage
    resnet_width: int = 16                 # channels of the first stage (doubling per stage)
    num_classes: int = 10


def _check(section) -> None:
    if not section.resnet_blocks or any(b < 1 for b in section.resnet_blocks):
        raise ConfigError(f"model.resnet_blocks must be a non-empty list of integers >= 1, got {section.resnet_blocks}")
    if section.resnet_width < 1 or section.num_classes < 2:
        raise ConfigError("model.resnet_width must be >= 1 and model.num_classes >= 2")


SPEC = ModelSpec(
    name="resnet", keys=ResNetKeys, data_kind="images",
    build=lambda section, seed, vocab: ResNet(tuple(section.resnet_blocks), section.resnet_width,
                                              section.num_classes, seed=seed),
    record=lambda model: dict(model.arch),
    rebuild=lambda kwargs, seed: ResNet(**{**kwargs, "blocks": tuple(kwargs["blocks"])}, seed=seed),
    check=_check,
    synthetic=lambda section: {"num_classes": section.num_classes})
