"""Shared parity machinery: train a small model with an engine on N ranks and with `single`
on the same global batch, and compare per-step losses and final full parameters.

Cases (chosen to break engines in the known ways):
- gpt: tied embedding/head, odd sizes (vocab 97, width 36, 3 heads), so nothing divides N;
  no biases: the attention key bias has an exactly-zero true gradient (softmax is
  shift-invariant), which Adam would turn from float noise into lr-sized steps;
- mlp: Linear(7,15), Linear(15,3): some ranks hold empty shards at N=3,4;
- resnet: convolutions, BatchNorm buffers. BatchNorm runs in eval mode (running statistics
  fixed): in train mode each rank normalizes by its own micro batch's statistics, which is
  what PyTorch's DDP does too and differs from one process by design.
Optimizers: plain SGD (a gradient off by N shows up at once) and AdamW.
The global batch (12) divides 1, 2, 3 and 4, and rank r takes rows [r*b, (r+1)*b).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import shardlab
from shardlab.models import GPT, GPTConfig, MLPModel, ResNet

GLOBAL_BATCH = 12
# Final-parameter tolerance per optimizer. SGD's update is linear in the gradient, so float32
# reduction-order noise stays ~1e-7. Adam divides by sqrt(v): for a near-zero gradient that
# noise becomes a visible fraction of an lr-sized step, so AdamW gets atol 1e-5 (lr is 1e-2);
# an N-fold gradient error would still move SGD parameters by ~lr*(N-1)*|g|, far above both.
PARAM_ATOL = {"sgd": 1e-6, "adamw": 1e-5}


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[str], nn.Module]          # device -> model
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # step -> global (inputs, targets)
    eval_bn: bool = False


def _gpt(device: str) -> nn.Module:
    with torch.device(device):
        return GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=3, n_embd=36, bias=False), seed=11)


def _gpt_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 97, (GLOBAL_BATCH, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _mlp(device: str) -> nn.Module:
    with torch.device(device):
        return MLPModel((7, 15, 3), seed=12)


def _mlp_batch(step: int):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def _resnet(device: str) -> nn.Module:
    with torch.device(device):
        return ResNet(blocks=(1, 1), width=4, num_classes=5, seed=13)


def _resnet_batch(step: int):
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)


CASES: dict[str, Case] = {
    "gpt": Case("gpt", _gpt, _gpt_batch),
    "mlp": Case("mlp", _mlp, _mlp_batch),
    "resnet": Case("resnet", _resnet, _resnet_batch, eval_bn=True),
}


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


def _set_mode(model: nn.Module, case: Case) -> None:
    model.train()
    if case.eval_bn:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()


def train_reference(case_name: str, opt_name: str, steps: int = 3, accumulate: int = 1,
                    clip: float | None = None) -> tuple[list[float], dict]:
    """One process, the whole global batch per step. clip: max global grad norm (None = off)."""
    case = CASES[case_name]
    model = case.build("cpu")
    _set_mode(model, case)
    opt = make_optimizer(opt_name, model.parameters())
    losses = []
    for step in range(steps):
        x, y = case.batch(step)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_engine(rank: int, world: int, case_name: str, strategy: str, opt_name: str, steps: int = 3,
                 accumulate: int = 1, meta: bool = True, clip: float | None = None,
                 **options) -> tuple[list[float], dict]:
    """Each rank takes its slice of the global batch; with accumulate=k the slice is split in
    k micro batches, the first k-1 backward passes inside no_sync. Returns the global mean
    loss per step and the final full state dict."""
    case = CASES[case_name]
    model = shardlab.parallelize(case.build("meta" if meta else "cpu"), strategy, device="cpu", **options)
    _set_mode(model, case)
    opt = make_optimizer(opt_name, model.parameters())
    b = GLOBAL_BATCH // world
    losses = []
    for step in range(steps):
        x, y = case.batch(step)
        x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        opt.zero_grad(set_to_none=True)
        total = 0.0
        mb = b // accumulate
        for i in range(accumulate):
            ctx = shardlab.no_sync(model) if i < accumulate - 1 else _null()
            with ctx:
                loss = model(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) / accumulate
                loss.backward()
            total += loss.item()
        if clip is not None:
            shardlab.clip_grad_norm_(model, clip)
        opt.step()
        t = torch.tensor([total])
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses, shardlab.full_state_dict(model)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def assert_parity(ref: tuple[list[float], dict], got: tuple[list[float], dict], label: str,
                  rtol: float = 1e-5, atol: float = 1e-6) -> None:
    ref_losses, ref_state = ref
    losses, state = got
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0.0,
                               msg=lambda m: f"{label}: per-step losses differ\n{m}")
    assert set(state) == set(ref_state), f"{label}: keys differ: {set(state) ^ set(ref_state)}"
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"{label}: parameter {k} differs\n{m}")
