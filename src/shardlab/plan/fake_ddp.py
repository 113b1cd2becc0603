"""PyTorch's `DistributedDataParallel` under plan's fake-tensor probes (plan/probe.py).

[Note: PyTorch DDP on fake tensors]
DDP's C++ reducer allocates what a DDP replica holds beyond the model: one flat gradient buffer
per bucket (`at::empty`, the bucket's parameters' bytes, no padding), first one bucket of every
parameter when it is built, then, at the first forward after the first synchronised backward,
buckets of `bucket_cap_mb` in the order gradients arrived (`_rebuild_buckets`); with
`gradient_as_bucket_view` it copies each gradient into its bucket view as autograd delivers it
and makes `.grad` that view, so the buckets outlive `zero_grad(set_to_none=True)` while a
`no_sync()` backward after it grows fresh gradients beside them; the all-reduce hook averages a
bucket in place. All of that goes through the dispatcher, so under FakeTensorMode it allocates
fake storages of the real sizes at the real moments, and the live tracker counts them as it
counts real ones. Only three things DDP does need values, and none of them is memory a step
holds; each is answered here as a real group of one replica would answer it:
- when built, it checks every rank's parameter shapes against each other by all-gathering a
  tensor of their sizes and reading it back (`_verify_param_shape_across_processes`): there is
  no other rank on a fake group, so the check is skipped (it runs before any step);
- when rebuilding its buckets it writes the new bucket assignment into int32 host tensors,
  broadcasts them from rank 0 and reads them back (`sync_bucket_indices`): those few tensors
  (a 4-byte index per parameter and per bucket) are made real, as they are in a real run;
- the all-reduce hook's future comes from the process group's work, and a fake group's work
  carries no value: `default_hooks._allreduce_fut` divides in place and all-reduces on the fake
  group as before, and returns a completed future holding the bucket (a real all-reduce returns
  the same tensor, reduced in place).
The reducer, its buckets, its copies and DDP's own forward hooks are PyTorch's, unchanged; the
fake-vs-real test (tests/test_plan_fake.py) checks the probe to the byte against torch-ddp's
real probe on a real one-rank gloo group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import distributed as ddp
from torch.utils._python_dispatch import TorchDispatchMode


class _RealHostInts(TorchDispatchMode):
    """int32 tensors made real: the reducer's bucket assignment, which it reads back."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.empty.memory_format and kwargs.get("dtype") == torch.int32:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _pre_forward_with_real_ints(original):
    def pre_forward(self, *inputs, **kwargs):
        with _RealHostInts():  # `_rebuild_buckets` runs here, once
            return original(self, *inputs, **kwargs)

    return pre_forward


def _allreduce_fut_on_fake_group(process_group, tensor):
    group = process_group if process_group is not None else dist.group.WORLD
    tensor.div_(group.size())
    dist.all_reduce(tensor, group=group, async_op=True).wait()
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(tensor)
    return done


@contextlib.contextmanager
def ddp_on_fake_tensors() -> Iterator[None]:
    """PyTorch DDP runnable under FakeTensorMode on a fake process group (see the Note)."""
    saved = [(ddp, "_verify_param_shape_across_processes"), (ddp.DistributedDataParallel, "_pre_forward"),
             (default_hooks, "_allreduce_fut")]
    originals = [getattr(owner, name) for owner, name in saved]
    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
    ddp.DistributedDataParallel._pre_forward = _pre_forward_with_real_ints(originals[1])
    default_hooks._allreduce_fut = _allreduce_fut_on_fake_group
    try:
        yield
    finally:
        for (owner, name), original in zip(saved, originals):
            setattr(owner, name, original)
