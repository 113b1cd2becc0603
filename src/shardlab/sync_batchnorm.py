"""`model.sync_batchnorm=true`: BatchNorm whose training statistics are those of the whole
data-parallel batch, so a run on N ranks normalizes exactly as one process would on the
N ranks' micro batches together (docs/verify.md).

[Note: BatchNorm under data parallelism]
In training mode BatchNorm normalizes with the mean and variance of the batch it sees. Under
data parallelism each rank sees only its own micro batch, so each normalizes with its own
statistics (what PyTorch's DDP does without SyncBatchNorm) and the model trained is not the
one a single process trains on the global batch; the running statistics drift per rank too.
Synchronised BatchNorm sums, per channel, the count, the sum and the sum of squares over the
ranks in forward (one all-reduce), and in backward the two per-channel sums the input
gradient needs (sum of dy and of dy * (x - mean); one all-reduce), the maths of torch's
`torch.nn.modules._functions.SyncBatchNorm`. The weight and bias gradients stay local, like
every other parameter's:
the engine averages them. On CUDA we use `torch.nn.SyncBatchNorm` itself; on CPU it refuses
to run (its kernels are GPU-only, torch 2.13), and PyTorch's DDP refuses any module that is a
`torch.nn.SyncBatchNorm` on CPU, so the CPU class below derives from `_BatchNorm` instead.

Statistics are accumulated in float64 whatever the input dtype, so the variance as
E[x^2] - E[x]^2 loses nothing to cancellation for activations whose mean is not many orders
of magnitude above their spread; for a float64 model this matches BatchNorm's own kernel to
rounding (the float64 test in tests/test_verify.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from shardlab.engines import collectives


def _channel_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A [C] tensor shaped to broadcast over x ([N, C, ...]) in x's dtype."""
    return v.to(x.dtype).view(1, -1, *([1] * (x.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward and backward of BatchNorm over the whole group's batch (see the Note above)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        dims = _channel_dims(x)
        x64 = x.detach().to(torch.float64)
        count = torch.full((1,), x.numel() // x.shape[1], dtype=torch.float64, device=x.device)
        stats = torch.cat([x64.sum(dims), (x64 * x64).sum(dims), count])
        collectives.all_reduce(stats, group=group)  # in the hang doctor's record
        C = x.shape[1]
        n = stats[-1]
        mean = stats[:C] / n
        var = (stats[C:2 * C] / n - mean * mean).clamp_min(0.0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_((mean * momentum).to(running_mean.dtype))
                unbiased = var * n / (n - 1).clamp_min(1.0)
                running_var.mul_(1 - momentum).add_((unbiased * momentum).to(running_var.dtype))
        xhat = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        ctx.save_for_backward(x, weight, mean, invstd, n)
        ctx.group = group
        out = xhat if weight is None else xhat * _per_channel(weight, x)
        return out if bias is None else out + _per_channel(bias, x)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd, n = ctx.saved_tensors
        dims = _channel_dims(x)
        xmu = x - _per_channel(mean, x)
        sum_dy = grad_out.sum(dims)
        sum_dy_xmu = (grad_out * xmu).sum(dims)
        grad_x = grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd.to(x.dtype)).to(weight.dtype)  # local: the engine averages it
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.clone()
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xmu])
            collectives.all_reduce(both, group=ctx.group)
            C = x.shape[1]
            mean_dy, mean_dy_xmu = both[:C] / n.to(x.dtype), both[C:] / n.to(x.dtype)
            scale = invstd.to(x.dtype) if weight is None else invstd.to(x.dtype) * weight.to(x.dtype)
            grad_x = (grad_out - _per_channel(mean_dy, x)
                      - xmu * _per_channel(invstd * invstd, x) * _per_channel(mean_dy_xmu, x)) * _per_channel(scale, x)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm (any dimensionality) with statistics over the process group in training mode;
    outside training, or without a group of more than one rank, plain BatchNorm."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: dist.ProcessGroup | None = None,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        group = self.process_group or (dist.group.WORLD if dist.is_initialized() else None)
        if not self.training or group is None or dist.get_world_size(group) == 1:
            return super().forward(input)
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as _BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked.item())
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias,
                                            self.running_mean if self.track_running_stats else None,
                                            self.running_var if self.track_running_stats else None,
                                            self.eps, momentum, group)


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """`module` with every BatchNorm replaced by a synchronised one: torch.nn.SyncBatchNorm on
    CUDA, this module's SyncBatchNorm elsewhere. The same Parameter and buffer objects move over
    (meta tensors included), so names, ties and initialization are unchanged."""
    cls = nn.SyncBatchNorm if device.type == "cuda" else SyncBatchNorm
    if isinstance(module, _BatchNorm) and not isinstance(module, (nn.SyncBatchNorm, SyncBatchNorm)):
        new = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                  device="meta")
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        new.running_mean, new.running_var = module.running_mean, module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        if hasattr(module, "qconfig"):
            new.qconfig = module.qconfig
        return new
    for name, child in module.named_children():
        new_child = convert_sync_batchnorm(child, device)
        if new_child is not child:
            setattr(module, name, new_child)
    return module
