"""What the data sources say when a corpus has no validation split: the reason in terms of what
the user did (issue 46). data.source=text is tokenized by shardlab itself, so its line names
data.val_fraction and never a `shardlab prepare` the user did not run; a prepared corpus
(data.source=tokens) names the --val-fraction it was prepared with. No processes: a few
kilobytes tokenized in this one."""

from __future__ import annotations

import pytest

from shardlab.config import load_config
from shardlab.data import build_datasets
from shardlab.data.prepare import prepare

TEXT = "".join(f"Line {i} of a short text file, long enough for some windows of sixteen bytes.\n" for i in range(40))


def _validation_line(capsys: pytest.CaptureFixture, *overrides: str) -> str:
    d = build_datasets(load_config(None, ["data.seq_len=16", "train.global_batch_size=4", "train.micro_batch_size=2",
                                          *overrides]))
    assert d.val is None
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("data: validation:")]
    return line


def test_a_text_corpus_without_a_split_names_what_the_user_set(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "one.txt").write_text(TEXT)
    line = _validation_line(capsys, "data.source=text", f"data.path={tmp_path / 'one.txt'}")
    # one file is one document, and a corpus's first document is never held out
    assert "data.source=text's corpus (tokenized by shardlab with data.val_fraction=0.05) has no validation " \
           "split: it held out none of its 1 document(s)" in line, line
    assert "data.val_from_train=true" in line and "give data.path more files" in line
    assert "--val-fraction" not in line and "prepare" not in line, line
    line = _validation_line(capsys, "data.source=text", f"data.path={tmp_path / 'one.txt'}", "data.val_fraction=0")
    assert "data.val_fraction=0" in line and "holds no text out" in line and "set data.val_fraction above 0" in line


def test_a_prepared_corpus_without_a_split_names_its_prepare(tmp_path, capsys):
    (tmp_path / "one.txt").write_text(TEXT)
    path = prepare([str(tmp_path / "one.txt")], str(tmp_path / "tokens"), val_fraction=0.0, progress=False)
    line = _validation_line(capsys, "data.source=tokens", f"data.path={path}")
    assert f"{path} (prepared with --val-fraction 0.0) has no validation split: it holds no text out" in line, line
    assert "prepare it with --val-fraction F" in line and "data.val_from_train=true" in line
