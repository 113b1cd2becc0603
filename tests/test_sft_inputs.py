"""data.source=sft reads what `shardlab prepare` reads: UltraChat-style Parquet with a
`messages` column, compressed JSONL, JSON arrays, CSV, `datasets` folders, folders and globs;
compared example by example with the records the test wrote; broken files named in one line."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from shardlab.data import sft, sft_examples
from tests.test_prepare_shapes import save_dict_to_disk, save_to_disk


def chats(n: int, seed: int) -> list[dict]:
    return [{"prompt": f"question {seed}-{i}, with a comma", "prompt_id": f"{seed}{i:04d}",
             "messages": [{"role": "user", "content": f"question {seed}-{i}, with a comma"},
                          {"role": "assistant", "content": f"answer {i} \u00e9\n" * (1 + i % 3)}]}
            for i in range(n)]


def alpacas(n: int, seed: int) -> list[dict]:
    return [{"instruction": f"do {seed}-{i}", "input": "" if i % 2 else f"with {i}", "output": f"done {i}"}
            for i in range(n)]


def expected(records: list[dict]) -> list[dict]:
    return [sft_examples.check_example(r, "truth") for r in records]


def write_corpus(root) -> list[dict]:
    """A folder of every shape; the examples in the order read_examples gives them."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    os.makedirs(root / "sub")
    a, b, c, d, e = chats(30, 1), alpacas(20, 2), chats(10, 3), alpacas(5, 4), chats(12, 5)
    pq.write_table(pa.Table.from_pylist(a), root / "a-ultrachat.parquet", row_group_size=8)
    (root / "b.jsonl.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n"
                                                                              for r in b).encode()))
    (root / "sub" / "c.json").write_text(json.dumps(c))
    with open(root / "sub" / "d.csv", "w", newline="") as f:
        import csv

        w = csv.DictWriter(f, ["instruction", "input", "output"])
        w.writeheader()
        w.writerows(d)
    save_to_disk(root / "sub" / "e-ds", {"messages": [r["messages"] for r in e]}, files=2)
    return expected(a + b + c + d + e)


def test_every_shape_of_prepare_reads_example_by_example(tmp_path):
    want = write_corpus(tmp_path / "corpus")
    assert sft_examples.read_examples(str(tmp_path / "corpus")) == want
    assert sft_examples.read_examples(str(tmp_path / "corpus" / "a-ultrachat.parquet")) == want[:30]
    assert sft_examples.read_examples(str(tmp_path / "corpus" / "*.gz")) == want[30:50]
    assert sft_examples.read_examples(str(tmp_path / "corpus" / "sub" / "e-ds")) == want[-12:]
    pc = [{"prompt": "p", "completion": "c"},
          {"prompt": [{"role": "user", "content": "p"}], "completion": [{"role": "assistant", "content": "c"}]}]
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pc))
    chat = {"messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "c"}]}
    assert sft_examples.read_examples(str(tmp_path / "pc.jsonl")) == [chat, chat]


def test_broken_files_are_one_line_naming_the_file(tmp_path):
    good = json.dumps(alpacas(1, 0)[0]) + "\n"
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(good.encode() * 200)[:-30])
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress((good + '{"instruction": "x"\n').encode()))
    (tmp_path / "bin.jsonl").write_bytes(b"\x00\x01" * 100)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": "hi"}]}]),
                   tmp_path / "no-answer.parquet")
    save_dict_to_disk(tmp_path / "dd", {"train_sft": {"text": ["a"]}, "test_sft": {"text": ["b"]}})
    for name, message in (("cut.jsonl.gz", r"cut.jsonl.gz: cannot .* gz .*damaged or truncated"),
                          ("bad.jsonl.gz", r"bad.jsonl.gz:2: not valid JSON"),
                          ("bin.jsonl", r"bin.jsonl: not a document \(holds NUL bytes"),
                          ("no-answer.parquet", r"no-answer.parquet: row 1: no response"),
                          ("dd", r"dd: a DatasetDict of splits \['train_sft', 'test_sft'\]; give the one to train "
                                 r"on: data.path=.*dd/train_sft")):
        with pytest.raises(sft.SFTDataError, match=message) as e:
            sft_examples.read_examples(str(tmp_path / name))
        assert "\n" not in str(e.value) and str(tmp_path / name) in str(e.value)


def test_sft_from_a_folder_of_parquet_and_jsonl_gz_trains_at_two_ranks(tmp_path, monkeypatch, capfd):
    from shardlab.cli import main

    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "cache"))
    want = write_corpus(tmp_path / "corpus")
    rc = main(["train", "configs/sft-mistral-tiny.yaml", "--nproc", "2", f"data.path={tmp_path / 'corpus'}",
               "data.seq_len=64", "train.steps=2", "train.global_batch_size=4", "train.micro_batch_size=2",
               "train.eval_batches=1", "export.format=none", f"output.dir={tmp_path / 'runs'}",
               "output.progress=false", "output.tensorboard=false"])
    assert rc == 0
    assert f"data: {len(want)} examples from {tmp_path / 'corpus'}: 0 dropped" in capfd.readouterr().out
