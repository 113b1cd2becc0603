"""`make gpu-check` (pytest -m gpu tests/gpu): the checks need one NVIDIA GPU. Without CUDA every
one of them is skipped with a message that says so, and nothing is written."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = ("no CUDA device here (torch.cuda.is_available() is False): `make gpu-check` validates shardlab on one "
           "NVIDIA GPU (NCCL, bf16/fp16, CUDA memory against plan, bench with MFU) and writes a dated report to "
           "docs/gpu-check/; run it on a GPU machine with a CUDA build of torch (TORCH_SPEC, see the Makefile). "
           "Nothing was run, no report written.")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
