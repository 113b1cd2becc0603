"""Elastic training: the batch layout at any world size (elastic.py), the node range checked
before any worker starts."""

import pytest

from shardlab import cli
from shardlab.elastic import layout_for, parse_nnodes
from shardlab.errors import ConfigError
from tests.test_config import no_workers  # noqa: F401 - the fixture


@pytest.mark.parametrize("world,micro,expect", [
    (1, 4, (4, 4)), (2, 4, (4, 2)), (4, 4, (4, 1)),   # the configured micro batch kept
    (8, 4, (2, 1)),                                      # more ranks than micro batches: lowered
    (3, 4, None), (5, 4, None),                          # 16 does not divide over 3 or 5 ranks
])
def test_layout_keeps_the_global_batch(world, micro, expect):
    if expect is None:
        with pytest.raises(ConfigError, match="world sizes that work: 1, 2, 4, 8, 16"):
            layout_for(16, micro, world)
        return
    lay = layout_for(16, micro, world)
    assert (lay.micro, lay.accumulation) == expect
    assert lay.world_size * lay.micro * lay.accumulation == 16
    assert (lay.note(16) is not None) == (lay.micro != micro)


def test_layout_lowers_to_the_largest_micro_that_divides():
    lay = layout_for(24, 5, 2)  # 12 per rank: 4 is the largest micro batch <= 5 dividing it
    assert (lay.micro, lay.accumulation) == (4, 3)
    assert "micro batch 4 x 3 accumulation" in lay.note(24)


@pytest.mark.parametrize("text,expect", [("2", (2, 2)), ("1:2", (1, 2)), ("3:2", None), ("0:2", None),
                                         ("a:b", None), ("1:2:3", None)])
def test_parse_nnodes(text, expect):
    if expect is None:
        with pytest.raises(ConfigError, match="--nnodes"):
            parse_nnodes(text)
    else:
        assert parse_nnodes(text) == expect


@pytest.mark.parametrize("args,fragment", [
    (["--nnodes", "3:2"], "needs 1 <= MIN <= MAX"),
    (["--nnodes", "0:2"], "needs 1 <= MIN <= MAX"),
    # 2 per node: sizes 2, 4, 6; 16 samples have no layout over 6 ranks
    (["--nnodes", "1:3"], "--nnodes 1:3 x --nproc 2: at 3 node(s), train.global_batch_size=16 has no layout at "
                          "world size 6"),
])
def test_bad_node_range_fails_before_workers(args, fragment, no_workers, capsys):  # noqa: F811
    code = cli.main(["train", "--nproc", "2", *args, "train.global_batch_size=16"])
    assert code == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err
