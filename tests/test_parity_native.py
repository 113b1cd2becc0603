"""torch-ddp and torch-fsdp match `single` on the same global batch (issue 2's proof for
PyTorch's own engines). One spawn per world size; every case runs inside it."""

import pytest

from shardlab.testing import run_workers
from tests.parity import CASES, PARAM_ATOL, assert_parity, train_engine, train_reference

STRATEGIES = ("torch-ddp", "torch-fsdp")
OPTIMIZERS = ("sgd", "adamw")


def _all_cases(rank, world):
    return {(s, c, o): train_engine(rank, world, c, s, o)
            for s in STRATEGIES for c in CASES for o in OPTIMIZERS}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_native_engines_match_single(world):
    results = run_workers(world, _all_cases)
    for key, got in results[0].items():
        strategy, case, opt = key
        assert_parity(train_reference(case, opt), got, f"{strategy}/{case}/{opt}/N={world}", atol=PARAM_ATOL[opt])
        for r in range(1, world):  # every rank reports the same losses and full parameters
            assert_parity(got, results[r][key], f"{strategy}/{case}/{opt} rank {r} vs rank 0", rtol=0, atol=0)
