"""`shardlab prepare` on corpora shaped like the public ones (data/formats.py, data/inputs.py):
compressed files, JSON arrays, binaries and VCS folders in a tree, bad records, many files."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import itertools
import json
import lzma
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from shardlab.data.prepare import prepare
from shardlab.data.shards import DataError, read_manifest
from tests.test_prepare import DOCS, WORDS, as_jsonl, stream


def _compress(path, kind: str) -> str:
    data = open(path, "rb").read()
    if kind == "zst":
        zstandard = pytest.importorskip("zstandard")
        packed = zstandard.ZstdCompressor().compress(data[: len(data) // 2]) + \
            zstandard.ZstdCompressor().compress(data[len(data) // 2:])  # two frames, as pzstd writes
    else:
        packed = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[kind](data)
    out = f"{path}.{kind}"
    with open(out, "wb") as f:
        f.write(packed)
    return out


def test_compressed_jsonl_and_json_arrays_give_the_tokens_of_plain_jsonl(tmp_path):
    plain = as_jsonl(tmp_path, DOCS)
    ref = stream(prepare([plain], str(tmp_path / "ref"), field="body"))
    for kind in ("gz", "zst", "bz2", "xz"):
        got = prepare([_compress(plain, kind)], str(tmp_path / f"out-{kind}"), field="body")
        assert stream(got) == ref, kind
        assert read_manifest(got).raw["inputs"][0]["compression"] == kind
    array = tmp_path / "docs.json"  # a JSON array of records, gzipped under a name that hides it
    array.write_text(json.dumps([{"text": d} for d in DOCS]))
    hidden = tmp_path / "array.json"
    hidden.write_bytes(gzip.compress(array.read_bytes()))
    os.remove(array)
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    assert stream(prepare([str(hidden)], str(tmp_path / "arr"))) == \
        stream(prepare([str(tmp_path / "text.jsonl")], str(tmp_path / "lines")))
    assert ref[0]  # the reference held text


def test_a_compressed_text_file_is_one_document(tmp_path):
    doc = (DOCS[3] * 200).encode()  # > 1 MiB decompressed: read in several parts, one document
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(doc))
    tokens, ends = stream(prepare([str(tmp_path / "a.txt.gz")], str(tmp_path / "out")))
    assert bytes(tokens) == doc + b"\xff" and ends == [len(doc) + 1]


def test_binaries_and_vcs_folders_are_skipped_and_counted(tmp_path):
    tree = tmp_path / "tree"
    (tree / ".git" / "objects").mkdir(parents=True)
    (tree / ".git" / "objects" / "ab12").write_bytes(b"x\x01" + os.urandom(300))
    (tree / ".git" / "HEAD").write_text("ref: refs/heads/main\n")  # text, but inside .git
    (tree / "notes.txt").write_text(DOCS[0])
    (tree / "tool.bin").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(100))
    (tree / "noise.dat").write_bytes(bytes(range(128, 256)) * 8)  # no NUL, but not UTF-8
    (tree / "c4.json.gz").write_bytes(gzip.compress(json.dumps({"text": DOCS[1]}).encode() + b"\n"))
    m = read_manifest(prepare([str(tree)], str(tmp_path / "out")))
    c = m.raw["counts"]
    assert c["documents"] == 2 and c["skipped_files"] == 2
    assert any("noise.dat" in s and "not UTF-8" in s for s in c["skipped_files_first"])
    assert any("tool.bin" in s and "NUL" in s for s in c["skipped_files_first"])
    assert [i["format"] for i in m.raw["inputs"]] == ["jsonl", "text"]
    assert c["replaced_invalid_utf8_bytes"] == 0
    with pytest.raises(DataError, match="tool.bin: not a document .*NUL"):  # named on its own: refused
        prepare([str(tree / "tool.bin")], str(tmp_path / "refused"))


def _records(tmp_path, lines: list[str]) -> str:
    p = tmp_path / "r.jsonl"
    p.write_text("".join(line + "\n" for line in lines))
    return str(p)


def test_bad_records_are_skipped_and_counted_with_their_line(tmp_path):
    good = [json.dumps({"text": d}) for d in DOCS[:6]]
    path = _records(tmp_path, good[:2] + ['{"body": "x"}'] + good[2:4] + ["not json"] + good[4:] + ['{"text": 3}'])
    m = read_manifest(prepare([path], str(tmp_path / "out")))
    c = m.raw["counts"]
    assert c["bad_records"] == 3 and c["documents"] == 6
    assert [s.split(": ")[0] for s in c["bad_records_first"]] == [f"{path}:3", f"{path}:6", f"{path}:9"]
    assert "no field 'text'" in c["bad_records_first"][0] and "holds int" in c["bad_records_first"][2]
    with pytest.raises(DataError, match=rf"{path}:3: no field 'text' .*--on-bad-record skip"):
        prepare([path], str(tmp_path / "strict"), on_bad_record="fail")
    assert not (tmp_path / "strict").exists()


def test_line_numbers_hold_across_pieces(tmp_path):
    line = json.dumps({"text": "w" * 1000})
    lines = [line] * 3000  # about 3 MiB: three pieces
    lines[2500] = '{"body": 1}'
    path = _records(tmp_path, lines)
    m = read_manifest(prepare([path], str(tmp_path / "out"), shard_mb=0.5))
    assert m.raw["counts"]["bad_records_first"][0].startswith(f"{path}:2501: ")


def test_many_small_files_are_spread_over_units_that_carry_their_own_inputs(tmp_path):
    from shardlab.data import inputs as ins
    from shardlab.data import units as un

    tree = tmp_path / "many"
    tree.mkdir()
    for i in range(400):
        (tree / f"f{i:04d}.txt").write_text(DOCS[i % len(DOCS)] * 30)  # ~400 files of 5-40 KiB
    inputs, _ = ins.scan_inputs([str(tree)])
    pieces = ins.plan_pieces(inputs, "text")
    units = un.plan_units(inputs, pieces, un.unit_target(pieces, 64 << 20), 64 << 20)
    tasks = list(un.unit_tasks(inputs, units))
    assert len(units) >= 2 and all(kind == "unit" for kind, _ in tasks)  # small files: hashed in their unit
    assert all(set(arg[2]) == {p.input for p in arg[1]} for _, arg in tasks)
    one = prepare([str(tree)], str(tmp_path / "w1"), workers=1)
    two = prepare([str(tree)], str(tmp_path / "w2"), workers=2)
    assert stream(one) == stream(two)
    assert read_manifest(one).raw["inputs"] == read_manifest(two).raw["inputs"]


def test_byte_corpora_take_one_byte_per_token(tmp_path):
    m = read_manifest(prepare([as_jsonl(tmp_path, DOCS)], str(tmp_path / "out"), field="body"))
    assert m.raw["dtype"] == "uint8"
    shard = m.split("train")["shards"][0]
    assert shard["bin"]["bytes"] == shard["tokens"]
    assert np.fromfile(os.path.join(m.path, shard["bin"]["name"]), dtype=np.uint8)[-1] == 0xFF


def test_bad_inputs_are_one_line_errors(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"body": 1}\n')
    (tmp_path / "broken.gz").write_bytes(gzip.compress(b"hello " * 1000)[:40])
    for args, expect in (([str(tmp_path / "x.jsonl"), "--on-bad-record", "fail"], "x.jsonl:1: no field"),
                         ([str(tmp_path / "broken.gz")], "damaged or truncated")):
        r = subprocess.run([sys.executable, "-m", "shardlab", "prepare", *args, "--out", str(tmp_path / "o"),
                            "--workers", "1"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and expect in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_data_inspect_describes_and_decodes(tmp_path, capsys):
    from shardlab.cli import main

    path = _records(tmp_path, [json.dumps({"text": d}) for d in DOCS[:4]] + ['{"x": 1}'])
    out = prepare([path], str(tmp_path / "out"), val_fraction=0.0)
    assert main(["data", "inspect", out, "--docs", "2", "--chars", "10000"]) == 0
    text = capsys.readouterr().out
    assert "dtype uint8, tokenizer bytes (vocab 256" in text and "train: 4 documents" in text
    assert "bad records skipped: 1" in text and f"{path}:5: no field 'text'" in text
    assert f"--- train document 1 ({len(DOCS[1].encode()) + 1:,} tokens) ---\n{DOCS[1]}" in text
    assert main(["data", "inspect", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err


def test_exact_dedup_keeps_the_first_copy_whatever_the_workers(tmp_path):
    docs = [DOCS[i % 5] + f"#{i % 7}\n" for i in range(70)]  # 35 distinct documents, each twice
    path = _records(tmp_path, [json.dumps({"text": d}) for d in docs])
    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(3):  # two identical text files and one of its own
        (tree / f"t{i}.txt").write_text(DOCS[6] if i < 2 else DOCS[7])
    kw = dict(shard_mb=0.002, val_fraction=0.2, dedup="exact")
    one = read_manifest(prepare([path, str(tree)], str(tmp_path / "w1"), workers=1, **kw))
    two = read_manifest(prepare([path, str(tree)], str(tmp_path / "w2"), workers=2, **kw))
    assert one.raw["counts"]["duplicates"] == 36 and one.raw["counts"]["documents"] == 37
    assert len(one.split("train")["shards"]) > 2  # duplicates across units, not only within one
    assert stream(one.path) == stream(two.path) and stream(one.path, "val") == stream(two.path, "val")
    seen = []
    for split in ("train", "val"):
        tokens, ends = stream(one.path, split)
        seen += [bytes(tokens[a:b - 1]).decode() for a, b in zip([0, *ends[:-1]], ends)]
    expected = list(dict.fromkeys(docs)) + [DOCS[6], DOCS[7]]
    assert sorted(seen) == sorted(expected)
    train_docs, _ = stream(read_manifest(prepare([path], str(tmp_path / "all"), shard_mb=0.002)).path)
    assert bytes(train_docs).count(b"\xff") == 70  # without --dedup every copy stays


def _big_jsonl(tmp_path) -> tuple[str, list[str]]:
    """About 3 MiB of JSONL (three pieces): a duplicate of a record of the first piece in the last,
    a bad line in each later piece."""
    rng = random.Random(4)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400)))})
             for _ in range(2200)]
    lines[1500] = lines[7]
    lines[900], lines[2100] = "not json", '{"body": 1}'
    path = tmp_path / "big.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path), lines


def test_one_compressed_jsonl_is_split_and_equals_one_worker(tmp_path):
    """A compressed JSONL larger than a unit is decompressed once by the parent and cut into units
    for the workers (data/units.py): at 2 workers the output is the one of 1 worker byte for byte,
    with the documents, bad records (their true lines), duplicates and held-out split of the same
    file uncompressed (zstd; gzip too); a truncated file is refused; reading it is lazy."""
    from shardlab.data import inputs as ins
    from shardlab.data import units as un

    plain, lines = _big_jsonl(tmp_path)
    packed = _compress(plain, "zst")
    kw = dict(shard_mb=0.1, val_fraction=0.2, dedup="exact")
    ref = read_manifest(prepare([plain], str(tmp_path / "plain"), **kw))
    out = [prepare([packed], str(tmp_path / f"w{w}"), workers=w, **kw) for w in (1, 2)]
    names = sorted(os.listdir(out[0]))
    assert names == sorted(os.listdir(out[1])) and len([n for n in names if n.startswith("train-")]) >= 6
    for name in names:  # byte for byte, the manifest included
        assert open(os.path.join(out[0], name), "rb").read() == open(os.path.join(out[1], name), "rb").read(), name
    gz = _compress(plain, "gz")
    for got, path in ((out[0], packed), (prepare([gz], str(tmp_path / "gz"), workers=2, **kw), gz)):
        m = read_manifest(got).raw
        assert stream(got) == stream(ref.path) and stream(got, "val") == stream(ref.path, "val")
        same = ("documents", "bad_records", "duplicates", "replaced_invalid_utf8_bytes")  # input_bytes: on disk
        assert [m["counts"][k] for k in same] == [ref.raw["counts"][k] for k in same]
        assert m["counts"]["duplicates"] == 1 and m["counts"]["bad_records"] == 2
        assert [s.split(": ")[0] for s in m["counts"]["bad_records_first"]] == [f"{path}:901", f"{path}:2101"]
        assert m["inputs"][0]["sha256"] == hashlib.sha256(open(path, "rb").read()).hexdigest()
    with pytest.raises(DataError, match=rf"{packed}:901: not a JSON line"):
        prepare([packed], str(tmp_path / "strict"), workers=2, on_bad_record="fail", **kw)
    cut = tmp_path / "cut.jsonl.zst"  # an interrupted download: refused, split or read whole
    cut.write_bytes(open(packed, "rb").read()[:os.path.getsize(packed) // 2])
    for shard_mb in (0.1, 64):
        with pytest.raises(DataError, match=r"cut.jsonl.zst: .* damaged or truncated"):
            prepare([str(cut)], str(tmp_path / f"cut{shard_mb}"), shard_mb=shard_mb)

    inputs, _ = ins.scan_inputs([packed])
    pieces = ins.plan_pieces(inputs, "text")
    layout = un.plan_units(inputs, pieces, un.unit_target(pieces, 1 << 17), 1 << 17)
    assert layout == [un.Split(0, 1 << 17)]
    tasks = un.unit_tasks(inputs, layout)
    assert next(tasks) == ("hash", (0, inputs[0]))  # the file as stored, by a task of its own
    kind_, (n, first, held) = next(tasks)
    assert (kind_, n, set(held)) == ("unit", 0, {0}) and first[0].bytes < os.path.getsize(packed)  # not all read
    flat = first + [p for _, arg in tasks for p in arg[1]]
    assert b"".join(p.data for p in flat) == open(plain, "rb").read()
    assert [p.line for p in flat] == list(itertools.accumulate([1] + [p.data.count(b"\n") for p in flat[:-1]]))
    assert sum(p.bytes for p in flat) == os.path.getsize(packed)
    assert [p.last for p in flat] == [False] * (len(flat) - 1) + [True]


def test_the_shapes_benchmark_runs_small(tmp_path):
    """`python -m shardlab.data.bench_shapes --only jsonl` (docs/data.md's figures) at 1 MiB."""
    from shardlab.data import bench_shapes

    rows = tmp_path / "rows.json"
    assert bench_shapes.main(["--only", "jsonl", "--jsonl-mib", "1", "--json", str(rows)]) == 0
    got = json.loads(rows.read_text())
    assert all(got[k]["secs_1"] > 0 and got[k]["secs_2"] > 0 for k in ("jsonl", "jsonl.zst"))
    assert got["zst/plain speed, 2 worker(s)"] > 0
