"""`shardlab prepare` on the shapes a trial found silently wrong: CSV/TSV (read as tables, never
one document), byte-order marks (dropped, every record kept), `datasets` save_to_disk folders
anywhere in a tree (read with pyarrow alone). Each compares document by document with the
documents the test wrote (bytes tokenizer: a document's tokens are its UTF-8 bytes)."""

from __future__ import annotations

import csv
import gzip
import json
import os
import random

import numpy as np
import pytest

from shardlab.data.prepare import prepare
from shardlab.data.shards import DataError, read_manifest

BOM = b"\xef\xbb\xbf"


def truth(n: int, seed: int) -> list[str]:
    """Documents with what breaks naive readers: commas, quotes, tabs, newlines, non-ASCII."""
    rng = random.Random(seed)
    words = ["data", "a,b", 'say "hi"', "tab\there", "two\nlines", "é", "日本", "plain", "end."]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 25))) for _ in range(n)]


def documents(out: str, split: str = "train") -> list[str]:
    """A split's documents, decoded (bytes tokenizer)."""
    m = read_manifest(out)
    docs: list[str] = []
    for shard in m.split(split)["shards"]:
        ids = np.fromfile(os.path.join(out, shard["bin"]["name"]), dtype=np.uint8)
        ends = np.fromfile(os.path.join(out, shard["idx"]["name"]), dtype="<i8")
        docs += [bytes(ids[a:b - 1]).decode() for a, b in zip([0, *ends[:-1]], ends)]
    return docs


def _prep(tmp_path, specs, name: str, **kw) -> tuple[list[str], dict]:
    out = prepare([str(s) for s in specs], str(tmp_path / f"out-{name}"), val_fraction=0.0, progress=False, **kw)
    return documents(out), read_manifest(out).raw["counts"]


def save_to_disk(path, columns: dict[str, list], files: int = 1) -> None:
    """A folder as `datasets.Dataset.save_to_disk` writes it (Arrow IPC streams, state.json,
    dataset_info.json), written with pyarrow: the datasets package is not needed."""
    import pyarrow as pa

    os.makedirs(path)
    table, rows = pa.table(columns), len(next(iter(columns.values())))
    names = [f"data-{k:05d}-of-{files:05d}.arrow" for k in range(files)]
    for k, name in enumerate(names):
        part = table.slice(k * rows // files, (k + 1) * rows // files - k * rows // files)
        with pa.ipc.new_stream(os.path.join(path, name), table.schema) as w:
            w.write_table(part, max_chunksize=7)
    with open(os.path.join(path, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_split": None}, f)
    with open(os.path.join(path, "dataset_info.json"), "w") as f:
        json.dump({"features": {c: {"dtype": "string", "_type": "Value"} for c in columns}}, f)


def save_dict_to_disk(path, splits: dict[str, dict[str, list]]) -> None:
    os.makedirs(path)
    with open(os.path.join(path, "dataset_dict.json"), "w") as f:
        json.dump({"splits": list(splits)}, f)
    for name, columns in splits.items():
        save_to_disk(os.path.join(path, name), columns)


def test_csv_and_tsv_rows_are_documents_of_the_field_column(tmp_path):
    docs = truth(500, 1)
    with open(tmp_path / "train.csv", "w", newline="", encoding="utf-8-sig") as f:  # with a BOM, as Excel
        w = csv.writer(f)
        w.writerow(["id", "text", "source"])
        w.writerows([i, d, "web"] for i, d in enumerate(docs))
    got, counts = _prep(tmp_path, [tmp_path / "train.csv"], "csv")
    assert got == docs and counts["byte_order_marks"] == 1 and counts["bad_records"] == 0
    with open(tmp_path / "t.tsv", "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["body"])
        w.writerows([d] for d in docs[:50])
    (tmp_path / "t.tsv.gz").write_bytes(gzip.compress((tmp_path / "t.tsv").read_bytes()))
    os.remove(tmp_path / "t.tsv")
    got, _ = _prep(tmp_path, [tmp_path / "t.tsv.gz"], "tsv", field="body")
    assert got == docs[:50]
    with pytest.raises(DataError, match=r"train.csv: a CSV whose header row has no column 'body' \(it has "
                                        r"\['id', 'text', 'source'\]\); pass --field NAME"):
        _prep(tmp_path, [tmp_path / "train.csv"], "refused", field="body")
    (tmp_path / "short.csv").write_text("text,id\nfirst,1\n\n2\n,3\nlast,4\n")  # blank, no text, empty text
    got, counts = _prep(tmp_path, [tmp_path / "short.csv"], "short")
    assert got == ["first", "2", "last"] and counts["bad_records"] == 0


def test_a_byte_order_mark_is_dropped_and_every_record_kept(tmp_path):
    docs = truth(50, 2)
    (tmp_path / "bom.txt").write_bytes(BOM + docs[0].encode())
    (tmp_path / "bom.jsonl").write_bytes(BOM + "".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    (tmp_path / "bom.json").write_bytes(BOM + json.dumps([{"text": d} for d in docs]).encode())
    for name in ("bom.txt", "bom.jsonl"):
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress((tmp_path / name).read_bytes()))
    for name, want in (("bom.txt", docs[:1]), ("bom.jsonl", docs), ("bom.json", docs), ("bom.txt.gz", docs[:1]),
                       ("bom.jsonl.gz", docs)):
        got, counts = _prep(tmp_path, [tmp_path / name], name)
        assert got == want, name
        assert (counts["byte_order_marks"], counts["bad_records"]) == (1, 0), name
    big = docs[1] * 40_000  # > 1 MiB: the key of a text file read in several pieces is BOM-free too
    (tmp_path / "big.txt").write_bytes(BOM + big.encode())
    assert _prep(tmp_path, [tmp_path / "big.txt"], "big", workers=2)[0] == [big]
    many = docs * 600  # a 3 MiB .jsonl.gz, split by prepare's process (data/units.py); a bad line named
    lines = [json.dumps({"text": d}) for d in many] + ['{"body": 1}']
    (tmp_path / "split.jsonl.gz").write_bytes(gzip.compress(BOM + "\n".join(lines).encode()))
    got, counts = _prep(tmp_path, [tmp_path / "split.jsonl.gz"], "split", workers=2, shard_mb=0.01)
    assert got == many and counts["byte_order_marks"] == 1
    assert len(read_manifest(str(tmp_path / "out-split")).split("train")["shards"]) >= 3  # it was split
    assert counts["bad_records_first"][0].startswith(f"{tmp_path / 'split.jsonl.gz'}:{len(lines)}: ")
    (tmp_path / "u16.txt").write_text(docs[0], encoding="utf-16")
    with pytest.raises(DataError, match=r"u16.txt: not a document \(UTF-16 text, not UTF-8; convert it first: iconv"):
        _prep(tmp_path, [tmp_path / "u16.txt"], "u16")


def test_datasets_folders_anywhere_in_a_tree(tmp_path):
    pytest.importorskip("pyarrow")
    docs = truth(700, 3)
    tree = tmp_path / "corpora"
    save_to_disk(tree / "wiki", {"text": docs[:300], "title": [str(i) for i in range(300)]}, files=3)
    (tree / "web.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[300:500]))
    save_dict_to_disk(tree / "deep" / "chat", {"train": {"text": docs[500:650]}, "test": {"text": docs[650:]}})
    got, counts = _prep(tmp_path, [tree], "tree", workers=2)
    assert got == docs[300:] + docs[:300]  # the files, then the folders (sorted; a DatasetDict in its order)
    assert (counts["bad_records"], counts["skipped_files"]) == (0, 0)
    got, _ = _prep(tmp_path, [tree / "deep" / "chat"], "dd-test", splits=["test"])
    assert got == docs[650:]
    with pytest.raises(DataError, match=r"chat: a DatasetDict without split 'val' \(its splits: \['train', 'test'\]\)"):
        _prep(tmp_path, [tree / "deep" / "chat"], "dd-val", splits=["val"])
    with pytest.raises(DataError, match=r"wiki: no column 'body' \(columns: \['text', 'title'\]\); pass --field"):
        _prep(tmp_path, [tree / "wiki"], "no-field", field="body")


def test_a_worker_killed_mid_unit_stops_the_prepare_naming_it(tmp_path, monkeypatch):
    """A worker the kernel kills (out of memory) took its unit with it: the pool would wait
    forever (the stall a user met); the prepare stops within seconds, naming the worker and unit."""
    import signal
    import time

    from shardlab.data import prepare as P

    docs = truth(40, 4)
    for i, d in enumerate(docs):
        (tmp_path / f"{i:02d}.txt").write_text(d)
    real = P.run_unit

    def dies(job, unit, pieces, inputs):
        if unit == 0:  # the workers are forked: they run this patched function
            os.kill(os.getpid(), signal.SIGKILL)
        return real(job, unit, pieces, inputs)

    monkeypatch.setattr(P, "run_unit", dies)
    monkeypatch.setattr(P, "unit_target", lambda pieces, shard: 1)  # a unit per file
    t0 = time.monotonic()
    with pytest.raises(DataError, match=r"worker \d+ was killed by SIGKILL .*out-of-memory.* while unit 0 "
                                        r"\(.*00.txt\); the prepare stopped"):
        _prep(tmp_path, [tmp_path], "killed", workers=2)
    assert time.monotonic() - t0 < 30 and not (tmp_path / "out-killed").exists()


def test_a_stuck_worker_stops_the_prepare_naming_it(tmp_path, monkeypatch, capfd):
    """A worker that uses no CPU on its unit (blocked for good) is named with its stack."""
    import threading

    from shardlab.data import prepare as P
    from shardlab.data import workers as W

    (tmp_path / "a.txt").write_text("x")
    real = P.run_unit

    def blocks(job, unit, pieces, inputs):
        threading.Event().wait()  # forever, without CPU
        return real(job, unit, pieces, inputs)

    monkeypatch.setattr(P, "run_unit", blocks)
    monkeypatch.setattr(W, "STUCK_S", 3.0)
    monkeypatch.setattr(W, "POLL_S", 0.5)
    with pytest.raises(DataError, match=r"worker \d+ has used no CPU for \d+ s on unit 0 \(.*a.txt\): stuck"):
        _prep(tmp_path, [tmp_path / "a.txt"], "stuck", workers=2)
    assert "in blocks" in capfd.readouterr().err  # the worker's stack, from faulthandler


def test_files_prepare_does_not_read_are_refused_named_or_counted_in_a_tree(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.feather as feather

    tree = tmp_path / "tree"
    tree.mkdir()
    feather.write_feather(pa.table({"text": ["a", "b"]}), tree / "t.feather")
    (tree / "u16.txt").write_bytes("plain words here".encode("utf-16-le"))  # no BOM
    (tree / "ok.txt").write_text("kept")
    got, counts = _prep(tmp_path, [tree], "tree")
    assert got == ["kept"] and counts["skipped_files"] == 2
    assert [s.split(": ", 1)[1][:26] for s in counts["skipped_files_first"]] == \
        ["a Feather file, a format p", "UTF-16LE text, not UTF-8; "]
    with pytest.raises(DataError, match=r"t.feather: not a document \(a Feather file, .* convert it to Parquet"):
        _prep(tmp_path, [tree / "t.feather"], "feather")


def test_data_source_text_reads_a_tree_with_a_datasets_folder(tmp_path, monkeypatch):
    pytest.importorskip("pyarrow")
    from shardlab.config import load_config
    from shardlab.data import build_datasets

    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "cache"))
    docs = truth(60, 6)
    save_to_disk(tmp_path / "tree" / "ds", {"text": docs[:50]})
    (tmp_path / "tree" / "a.txt").write_text(docs[50])
    build_datasets(load_config(None, ["data.source=text", f"data.path={tmp_path / 'tree'}", "data.seq_len=16"]))
    out = os.path.dirname(next((tmp_path / "cache" / "tokens").glob("*/manifest.json")))
    assert sorted(documents(out) + documents(out, "val")) == sorted(docs[:51])
