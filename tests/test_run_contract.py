"""What `shardlab train` does with a run directory that exists ([Note: the run contract] in
loop/run_contract.py) and how its output reads in a log ([Note: progress for terminals and for
logs] in loop/measurements.py): an unfinished run resumes, a finished one is said in one line
and nothing starts, --fresh trains beside it, checkpoint.resume=none never replaces checkpoints;
piped output has progress lines, not a bar's frames, and no notice for bars. One process each,
no workers: the runs are two steps of gpt-nano through `shardlab.cli.main`."""

import io
import json
import sys

import pytest

from shardlab.cli import main
from shardlab.config import load_config
from shardlab.loop.launcher import _show_worker_warnings
from shardlab.loop.measurements import line_interval
from shardlab.loop.run_contract import settle


def _args(tmp_path, *extra):
    return ["train", "configs/gpt-tiny.yaml", "parallel.strategy=single", "model.preset=gpt-nano", "data.seq_len=32",
            "train.steps=2", f"output.dir={tmp_path}", "output.tensorboard=false", "train.memory_tracking=none",
            *extra]


def test_finished_fresh_and_resume_none(tmp_path, capsys):
    """A finished run started again: one line, nothing trained or rewritten. --fresh: a new directory
    beside it trained from step 0, the line naming how to resume it. checkpoint.resume=none over
    the checkpoints: refused before anything starts, the checkpoints as they were."""
    assert main(_args(tmp_path)) == 0
    (run,) = tmp_path.iterdir()
    first = json.loads((run / "metrics.json").read_text())
    capsys.readouterr()
    assert main(_args(tmp_path)) == 0
    out = capsys.readouterr().out
    assert out == (f"shardlab: the run finished at step 2 (train.steps=2): nothing to do; its records are kept "
                   f"({run}/metrics.json); a higher train.steps trains on, --fresh starts over beside it\n")
    assert main([*_args(tmp_path), "--fresh"]) == 0
    fresh = tmp_path / f"{run.name}-2"
    out = capsys.readouterr().out
    assert out.startswith(f"shardlab: a fresh run in {fresh} ({run} is kept); `shardlab train {fresh}/config.yaml` "
                          "resumes this one\n")
    again = json.loads((fresh / "metrics.json").read_text())
    assert again["losses"] == first["losses"] and again["steps_this_run"] == 2  # from step 0, the same seed
    assert json.loads((run / "metrics.json").read_text()) == first
    assert main(["train", str(fresh / "config.yaml")]) == 0  # its config.yaml names it: finished
    assert capsys.readouterr().out.startswith("shardlab: the run finished at step 2")
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert main([*_args(tmp_path), "checkpoint.resume=none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: checkpoint.resume=none would train from step 0 over the checkpoints in "
                          f"{run}/checkpoints (latest: step 2)") and "--fresh" in err and err.count("\n") == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [run.name, fresh.name]


def test_fresh_needs_shardlab_launcher(tmp_path, capsys):
    """Workers of torchrun/srun, or an elastic agent, cannot agree on a new directory: the error
    names output.run_name instead, and no directory is made."""
    cfg = load_config("configs/gpt-tiny.yaml", [f"output.dir={tmp_path}"])
    assert settle(cfg, fresh=True, launched_worker=True, elastic=False) == 2
    assert "output.run_name=NAME" in capsys.readouterr().err
    assert settle(cfg, fresh=True, launched_worker=False, elastic=True) == 2
    assert settle(cfg, fresh=False, launched_worker=True, elastic=False) is None  # the workers decide
    assert list(tmp_path.iterdir()) == []


def test_piped_progress_is_lines(tmp_path, capsys):
    """stdout not a terminal (pytest captures it): a whole line every few steps and at the last,
    no bar frame."""
    assert main(_args(tmp_path, "train.steps=3", "output.run_name=r")) == 0
    out = capsys.readouterr().out.splitlines()
    progress = [line for line in out if line.startswith("single x1  step ")]
    assert [line.split()[3] for line in progress] == ["1/3", "2/3", "3/3"], out
    assert all(" loss " in line and " elapsed " in line for line in progress)
    assert not any("%|" in line or "\r" in line for line in out)


@pytest.mark.parametrize("steps, log_every, every", [(3, 1, 1), (20, 1, 2), (200, 1, 20), (2000, 1, 200),
                                                     (30, 1, 5), (20, 5, 5), (70, 1, 10)])
def test_line_interval(steps, log_every, every):
    assert line_interval(steps, log_every) == every


def test_bar_frames_are_not_warnings(tmp_path, capsys):
    """What the workers wrote to stderr is shown after a clean run, each line once whichever ranks
    wrote it (torch's rank prefix and log clock aside), but a progress bar's frames (split at their
    carriage returns) are neither shown nor counted."""
    logs = tmp_path / "attempt_0"
    frames = "\r".join(f"Writing model shards: {p}%|#   | {i}/5 [00:01<00:02, 2.00it/s]" for i, p in ((1, 20), (5, 100)))
    for rank in (0, 1):
        (logs / str(rank)).mkdir(parents=True)
        (logs / str(rank) / "stderr.log").write_text(
            f"{frames}\n[rank{rank}]:W1128 00:32:11.8{rank}0000 18{rank}8 torch/x.py:12] careful\n")
    _show_worker_warnings(str(logs), 2, limit=1)
    assert capsys.readouterr().err == "W torch/x.py:12] careful\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_progress_is_a_bar_with_lines_above_it(tmp_path, monkeypatch):
    """stdout a terminal: a bar drawn in place (carriage returns, no newline per step), and every
    line printed while it is drawn (each step's save) on a line of its own, the bar redrawn after it."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(_args(tmp_path, "train.steps=3", "checkpoint.every_steps=1", "output.run_name=t")) == 0
    out = terminal.getvalue()
    assert out.count("%|") >= 3 and "single x1  step " not in out
    for step in (1, 2, 3):
        before, _, after = out.partition(f"shardlab: checkpoint step {step}:")
        assert after and before.endswith(("\r", "\n")), before[-200:]  # not glued to a bar frame
        assert "\n" in after  # the save's line ends before anything is drawn again
    last_frame, _, summary = out[out.rindex("%|"):].partition("shardlab: single on 1 worker(s)")
    assert summary and "\n" in last_frame  # the bar's line ended before the summary
