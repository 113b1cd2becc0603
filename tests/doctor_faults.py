"""Faults planted in `shardlab train` workers for tests/test_doctor.py.

The test runs the real launcher with PYTHONPATH holding a generated sitecustomize.py that
imports this module in every process (launcher and workers) when SHARDLAB_TEST_FAULT is set:
  desync:R:K      model.name=gpt-desync: a GPT whose K-th training forward on rank R issues one
                  extra all-reduce, calling torch.distributed.all_reduce itself as a user's layer
                  would (recorded by the doctor's wrapper: engines/raw_collectives.py)
  raise:R:S       rank R raises ValueError at the start of step S
  data-stall:R:S  on rank R the training dataset sleeps (DATA_STALL_S) from step S's first sample
  data-slow:R:MS  on rank R the training dataset sleeps MS milliseconds at each step's first sample
                  (a straggler: tests/test_observe.py)
  kill:R:S        rank R kills itself (SIGKILL) at the start of step S of the first attempt only
Steps count from 1, as the heartbeat does.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

DATA_STALL_S = 120.0
PLANTED_BYTES = 12  # the planted all-reduce's payload: three float32, unlike any the loop issues (4 and 8 B)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


# ---------------------------------------------------------------------------------------- desync
@dataclasses.dataclass
class _NoKeys:
    """gpt-desync takes gpt's keys (model.preset, ...), which gpt's spec already declares."""


def register_desync_model(rank: int, forward_number: int) -> None:
    import torch.distributed as dist

    from shardlab.models import MODELS, gpt

    class DesyncGPT(gpt.GPT):
        forwards = 0

        def forward(self, idx, targets=None):  # noqa: ANN001, ANN201
            if self.training and _rank() == rank:
                DesyncGPT.forwards += 1
                if DesyncGPT.forwards == forward_number:
                    # the other ranks issue no such collective; PLANTED_BYTES tells it from the loop's own
                    dist.all_reduce(torch.ones(PLANTED_BYTES // 4))
            return super().forward(idx, targets)

    MODELS["gpt-desync"] = dataclasses.replace(
        gpt.SPEC, name="gpt-desync", keys=_NoKeys,
        build=lambda section, seed, vocab: DesyncGPT(gpt.gpt_config(section, vocab), seed=seed))


# ---------------------------------------------------------------------------------------- raise
def plant_raise(rank: int, step: int) -> None:
    from shardlab.loop import train as T

    original = T.train_step

    def train_step(run, tracker=None):  # noqa: ANN001, ANN202
        if _rank() == rank and run.state.step + 1 == step:
            raise ValueError(f"planted failure on rank {rank} at step {step}")
        return original(run, tracker)

    T.train_step = train_step


# ------------------------------------------------------------------------------------ data stall
class SleepyDataset(torch.utils.data.Dataset):
    """The training set, except that from sample number `after` on it sleeps before answering."""

    def __init__(self, inner: torch.utils.data.Dataset, after: int):
        self.inner, self.after, self.served = inner, after, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):  # noqa: ANN204
        self.served += 1
        if self.served > self.after:
            time.sleep(DATA_STALL_S)
        return self.inner[i]


def plant_data_stall(rank: int, step: int) -> None:
    from shardlab.loop import run as R

    original = R.build_datasets

    def build_datasets(cfg):  # noqa: ANN001, ANN202
        data = original(cfg)
        if _rank() == rank:
            per_step = cfg.train.global_batch_size // int(os.environ.get("WORLD_SIZE", "1"))
            data.train = SleepyDataset(data.train, after=per_step * (step - 1))
        return data

    R.build_datasets = build_datasets


# ------------------------------------------------------------------------------ straggler, kill
class SlowDataset(torch.utils.data.Dataset):
    """The training set, sleeping `seconds` before the first sample of each step (`per_step` samples)."""

    def __init__(self, inner: torch.utils.data.Dataset, per_step: int, seconds: float):
        self.inner, self.per_step, self.seconds, self.served = inner, per_step, seconds, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):  # noqa: ANN204
        if self.served % self.per_step == 0:
            time.sleep(self.seconds)
        self.served += 1
        return self.inner[i]


def plant_data_slow(rank: int, ms: int) -> None:
    from shardlab.loop import run as R

    original = R.build_datasets

    def build_datasets(cfg):  # noqa: ANN001, ANN202
        data = original(cfg)
        if _rank() == rank:
            per_step = cfg.train.global_batch_size // int(os.environ.get("WORLD_SIZE", "1"))
            data.train = SlowDataset(data.train, per_step, ms / 1000)
        return data

    R.build_datasets = build_datasets


def plant_kill(rank: int, step: int) -> None:
    import signal

    from shardlab.loop import train as T

    original = T.train_step

    def train_step(run, tracker=None):  # noqa: ANN001, ANN202
        if _rank() == rank and run.state.step + 1 == step and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(run, tracker)

    T.train_step = train_step


def plant(spec: str) -> None:
    kind, rank, n = spec.split(":")
    {"desync": register_desync_model, "raise": plant_raise, "data-stall": plant_data_stall,
     "data-slow": plant_data_slow, "kill": plant_kill}[kind](int(rank), int(n))


SITECUSTOMIZE = """\
import os
if os.environ.get("SHARDLAB_TEST_FAULT"):
    import tests.doctor_faults
    tests.doctor_faults.plant(os.environ["SHARDLAB_TEST_FAULT"])
"""
