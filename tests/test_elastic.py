"""Elastic training: the batch layout at any world size (data/loader.py), the node range (loop/elastic.py) checked
before any worker starts."""

import pytest

from shardlab import cli
from shardlab.data.loader import layout_for
from shardlab.errors import ConfigError
from shardlab.loop.elastic import parse_nnodes
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


def _tiny(tmp_path, name, *overrides):
    from shardlab.config import load_config

    return load_config("configs/gpt-tiny.yaml", ["parallel.strategy=single", "model.preset=gpt-nano",
                                                 "data.seq_len=32", "train.steps=4", "output.progress=false",
                                                 "output.tensorboard=false", "train.memory_tracking=none",
                                                 f"output.dir={tmp_path}", f"output.run_name={name}", *overrides])


@pytest.mark.parametrize("overrides,steps", [
    (["checkpoint.every_steps=2"], [2, 4]),
    # every_seconds tiny: due at every step boundary; async: committed in the background, reported later
    (["checkpoint.every_seconds=1e-9", "checkpoint.async=true"], [1, 2, 3, 4]),
])
def test_every_checkpoint_on_the_record(tmp_path, capsys, overrides, steps):
    import torch

    from shardlab.loop.runtime import Runtime
    from shardlab.loop.train import train

    result = train(_tiny(tmp_path, "run", *overrides), Runtime(0, 0, 1, torch.device("cpu"), None))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("shardlab: checkpoint step")]
    assert [int(ln.split()[3].rstrip(":")) for ln in lines] == steps, lines
    saves = result["checkpoint_saves"]
    assert [s["step"] for s in saves] == steps
    for s, ln in zip(saves, lines):
        assert s["bytes"] > 100_000 and 0 < s["blocking_s"] and 0 < s["write_s"]  # gpt-nano + AdamW state
        assert s["gb_s"] == pytest.approx(s["bytes"] / s["write_s"] / 1e9)
        assert f"{s['bytes'] / 2**20:.1f} MiB" in ln
    assert result["checkpoint_blocking_s"] == [s["blocking_s"] for s in saves]
    assert result["checkpoint_write_s"] == [s["write_s"] for s in saves]
    assert 0 < result["checkpoint_blocking_fraction"] < 1


def test_every_seconds_must_be_positive(no_workers, capsys):  # noqa: F811
    assert cli.main(["train", "--nproc", "2", "checkpoint.every_seconds=0"]) == 2
    assert "checkpoint.every_seconds must be > 0" in capsys.readouterr().err
