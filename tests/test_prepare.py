"""`shardlab prepare` and training on its shards (data/prepare.py, shards.py, tokens.py):
formats agree, workers do not change the output, bad data is refused before training with
a message naming the fix, an interrupted prepare leaves nothing training accepts."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from shardlab.config import load_config
from shardlab.data import build_datasets, shards
from shardlab.data.prepare import prepare
from shardlab.data.shards import DataError, TokenShards, read_manifest, verify_data_dir
from shardlab.data.tokens import check

WORDS = ["data", "shard", "token", "stream", "model", "rank", "batch", "step", "memory", "map", "the", "of", "é",
         "naïve", "日本"]


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(max(1, n // 40))]
    return "\n".join(lines) + "\n"


DOCS = [words(300 + 97 * i, i) for i in range(12)]


def stream(path: str, split: str = "train") -> tuple[list[int], list[int]]:
    """A prepared split's tokens and document ends, over all its shards."""
    m = read_manifest(path)
    s = TokenShards(m, split)
    ends, at = [], 0
    for shard in m.split(split)["shards"]:
        ends += [at + int(e) for e in np.fromfile(os.path.join(path, shard["idx"]["name"]), dtype="<i8")]
        at += shard["tokens"]
    return s.read(0, s.num_tokens).tolist(), ends


def as_text_files(tmp, docs) -> str:
    d = tmp / "txt"
    d.mkdir()
    for i, doc in enumerate(docs):
        (d / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return str(d)


def as_jsonl(tmp, docs) -> str:
    p = tmp / "docs.jsonl"
    p.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return str(p)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> str:
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer=trainer)
    out = tmp_path_factory.mktemp("bpe")
    tok.save(str(out / "tokenizer.json"))
    return str(out)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_text_jsonl_parquet_datasets_give_the_same_tokens(tmp_path, tokenizer, request):
    tok = None if tokenizer == "bytes" else request.getfixturevalue("bpe_dir")
    kw = {"tokenizer": tok, "val_fraction": 0.25, "field": "body"}
    ref = prepare([as_text_files(tmp_path, DOCS)], str(tmp_path / "from-text"), **kw)
    got = {"jsonl": prepare([as_jsonl(tmp_path, DOCS)], str(tmp_path / "from-jsonl"), **kw)}
    if importlib_ok("pyarrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": DOCS}), tmp_path / "docs.parquet", row_group_size=5)
        got["parquet"] = prepare([str(tmp_path / "docs.parquet")], str(tmp_path / "from-parquet"), **kw)
    if importlib_ok("datasets"):
        import datasets

        datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(tmp_path / "ds"))
        got["datasets"] = prepare([str(tmp_path / "ds")], str(tmp_path / "from-datasets"), **kw)
    train, val = stream(ref, "train"), stream(ref, "val")
    assert len(train[1]) + len(val[1]) == len(DOCS) and val[1] and train[1]  # some held out, whole documents
    eod = read_manifest(ref).raw["tokenizer"]["eod_id"]
    assert train[0].count(eod) == len(train[1]) and train[0][-1] == eod  # one end-of-document token each
    for fmt, path in got.items():
        assert (stream(path, "train"), stream(path, "val")) == (train, val), fmt
    if tok is None:  # bytes: the tokens are the UTF-8 bytes, documents joined by 0xFF
        assert bytes(train[0]).split(b"\xff")[0] == DOCS[0].encode()


def importlib_ok(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_workers_and_shard_size_do_not_change_the_tokens(tmp_path, tokenizer, request):
    tok = None if tokenizer == "bytes" else request.getfixturevalue("bpe_dir")
    big = tmp_path / "big.txt"  # one document of several pieces, cut inside lines without newlines too
    text = words(1_200_000, 1) + "x" * 200_000 + "é" * 300_000 + words(500_000, 2)
    big.write_text(text, encoding="utf-8")
    src = [str(big), as_jsonl(tmp_path, DOCS)]
    kw = {"tokenizer": tok, "val_fraction": 0.3, "field": "body"}
    one = prepare(src, str(tmp_path / "one"), workers=1, shard_mb=64, **kw)
    two = prepare(src, str(tmp_path / "two"), workers=2, shard_mb=0.2 if tok else 1, **kw)
    assert len(read_manifest(two).split("train")["shards"]) >= 3
    assert stream(one) == stream(two) and stream(one, "val") == stream(two, "val")
    tokens, ends = stream(one)
    if tok is None:
        assert bytes(tokens[:ends[0] - 1]) == big.read_bytes()  # bytes: the file itself
    else:  # the pieces and segments it was encoded in lose nothing
        from tokenizers import Tokenizer

        assert Tokenizer.from_file(os.path.join(tok, "tokenizer.json")).decode(tokens[:ends[0] - 1]) == text
    assert read_manifest(one).raw["inputs"][0]["sha256"] == read_manifest(two).raw["inputs"][0]["sha256"]


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 ok \xff\xfe end\n")
    m = read_manifest(prepare([str(tmp_path / "bad.txt")], str(tmp_path / "out")))
    assert m.raw["counts"]["replaced_invalid_utf8_bytes"] == 3
    assert bytes(stream(m.path)[0]) == "caf\ufffd ok \ufffd\ufffd end\n".encode() + b"\xff"


def _cfg(path: str, *extra: str):
    return load_config(None, ["data.source=tokens", f"data.path={path}", "data.seq_len=16",
                              "train.global_batch_size=4", "train.micro_batch_size=2", *extra])


def test_training_reads_windows_of_the_stream(tmp_path):
    path = prepare([as_text_files(tmp_path, DOCS)], str(tmp_path / "out"), shard_mb=0.001)  # many tiny shards
    d = build_datasets(_cfg(path))
    tokens, _ = stream(path)
    assert d.vocab_size == 256 and len(d.train) == (len(tokens) - 1) // 16
    for i in (0, 7, len(d.train) - 1):  # windows cross shard boundaries
        x, y = d.train[i]
        assert x.tolist() == tokens[i * 16:i * 16 + 16] and y.tolist() == tokens[i * 16 + 1:i * 16 + 17]
    assert d.info["manifest_sha256"] == read_manifest(path).sha256


def test_a_bpe_corpus_keeps_its_tokenizer_and_generate_decodes_with_it(tmp_path, bpe_dir, capsys):
    """prepare copies the tokenizer into DATA_DIR, a run copies it beside its checkpoints, and
    `shardlab generate` decodes with it, after the original tokenizer directory is gone (a cluster
    mount has only DATA_DIR). Before, generate fell back to bytes for a tokens corpus."""
    import shutil

    from shardlab.cli import main as cli_main
    from shardlab.data.text import Tokenizer
    from shardlab.export import load_model
    from shardlab.loop import train as T
    from tests.checkpoint_helpers import runtime

    original = tmp_path / "tok"
    shutil.copytree(bpe_dir, original)
    path = prepare([as_text_files(tmp_path, DOCS)], str(tmp_path / "out"), tokenizer=str(original))
    shutil.rmtree(original)
    assert read_manifest(path).raw["tokenizer"]["copy"] == "tokenizer"
    with open(os.path.join(path, "tokenizer", "tokenizer.json"), "rb") as a, \
            open(os.path.join(bpe_dir, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()
    cfg = _cfg(path, "model.name=gpt", "model.preset=gpt-nano", "model.vocab_size=300", "parallel.strategy=single",
               "train.steps=2", "checkpoint.every_steps=2", f"output.dir={tmp_path}/runs", "output.run_name=bpe",
               "output.progress=false", "output.tensorboard=false")
    T.train(cfg, runtime(0, 1, "single"))
    run = f"{tmp_path}/runs/bpe"
    assert os.path.isfile(f"{run}/tokenizer/tokenizer.json")
    _, info = load_model(run)
    assert info["tokenizer_dir"] == f"{run}/tokenizer" and Tokenizer(info["tokenizer_dir"]).vocab_size == 300
    capsys.readouterr()
    assert cli_main(["generate", run, "--prompt", "the data", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("the data")


def test_bad_corpora_are_refused_with_the_fix(tmp_path, bpe_dir):
    with pytest.raises(DataError, match="no manifest.json"):
        check(_cfg(str(tmp_path)))
    path = prepare([as_text_files(tmp_path, DOCS)], str(tmp_path / "bpe"), tokenizer=bpe_dir)
    with pytest.raises(DataError, match="model.vocab_size >= 300"):  # today an IndexError on every rank
        check(_cfg(path, "model.vocab_size=256"))
    check(_cfg(path, "model.vocab_size=300"))
    with pytest.raises(DataError, match="fewer than one global batch.*train.global_batch_size"):
        check(_cfg(path, "train.global_batch_size=4096", "train.micro_batch_size=1"))
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(DataError, match="empty corpus"):
        prepare([str(tmp_path / "empty.jsonl")], str(tmp_path / "empty"))
    raw = json.loads((tmp_path / "bpe" / "manifest.json").read_text())
    (tmp_path / "bpe" / "manifest.json").write_text(json.dumps({**raw, "version": 99}))
    with pytest.raises(DataError, match="format version 99.*prepare the corpus again"):
        check(_cfg(path))


def test_a_tampered_shard_is_refused(tmp_path):
    path = prepare([as_text_files(tmp_path, DOCS)], str(tmp_path / "out"))
    m = read_manifest(path)
    assert verify_data_dir(m) == "size"  # prepare hashed what it wrote: this machine knows the files
    shard = os.path.join(path, m.split("train")["shards"][0]["bin"]["name"])
    with open(shard, "r+b") as f:  # flip one byte in place: same size, new mtime
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(DataError, match="SHA-256 does not match"):
        check(_cfg(path))
    with open(shard, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="bytes, but manifest.json says"):
        check(_cfg(path))


def test_prepare_killed_leaves_nothing_training_accepts(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(words(1 << 20, 3) * 64)  # 64 MiB: the kill lands well before the end
    out = tmp_path / "data"
    proc = subprocess.Popen([sys.executable, "-m", "shardlab", "prepare", str(corpus), "--out", str(out),
                             "--workers", "1", "--shard-mb", "0.25"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(p.name.startswith(".data.tmp-") and any(p.glob("*.bin"))
                                                  for p in tmp_path.iterdir()):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)  # in the middle: shards written, manifest not yet
    proc.wait(30)
    assert not out.exists()
    tmp_dirs = [p for p in tmp_path.iterdir() if p.name.startswith(".data.tmp-")]
    assert tmp_dirs and list(tmp_dirs[0].glob("*.bin"))
    for candidate in (out, tmp_dirs[0]):
        with pytest.raises(DataError, match="shardlab prepare"):
            check(_cfg(str(candidate)))


def test_cli_refuses_bad_data_before_any_worker_starts(tmp_path):
    path = prepare([as_text_files(tmp_path, DOCS[:2])], str(tmp_path / "small"))
    out = subprocess.run([sys.executable, "-m", "shardlab", "train", "configs/gpt-tiny.yaml", "--nproc", "2",
                          "data.source=tokens", f"data.path={path}", "train.global_batch_size=512"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "fewer than one global batch" in out.stderr, out.stderr[-2000:]
    assert "rank" not in out.stderr.lower()  # said once, by the launcher, not by workers


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssFile from /proc")
def test_random_windows_do_not_grow_rss(tmp_path, monkeypatch):
    """[Note: constant RSS] in data/shards.py: without handing pages back, these reads map
    (and count in RSS) most of the 16 MiB of (uint8) shards; with it, RssFile stays flat."""
    def rss_file_mib() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssFile")) / 1024

    (tmp_path / "c.txt").write_text("".join(f"{i}\n" + words(1 << 20, i) for i in range(16)))
    d = build_datasets(_cfg(prepare([str(tmp_path / "c.txt")], str(tmp_path / "out"), shard_mb=8)))
    rng = random.Random(0)

    def grown(release: bool) -> float:
        monkeypatch.setattr(shards, "_DONTNEED", shards._DONTNEED if release else None)
        d.train[0]  # the first read maps code pages of its own
        before = rss_file_mib()
        for _ in range(3000):
            d.train[rng.randrange(len(d.train))]
        return rss_file_mib() - before

    assert grown(release=True) < 2
    assert grown(release=False) > 8  # what the release avoids (measured 15 MiB of 16)


def test_end_of_document_token_of_a_model_directory(tmp_path, bpe_dir):
    from shardlab.data.text import Tokenizer

    model_dir = tmp_path / "hf-model"  # an HF model directory: tokenizer.json beside tokenizer_config.json
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text(open(os.path.join(bpe_dir, "tokenizer.json")).read())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    tok = Tokenizer(str(model_dir))
    assert tok.eod_id == tok._tok.token_to_id("<|endoftext|>")
    assert tok.identity()["eod_token"] == "<|endoftext|>" and tok.identity()["vocab_size"] == 300
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    bare = HFTokenizer(models.BPE())  # no special token at all
    bare.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bare.train_from_iterator(DOCS, trainer=trainers.BpeTrainer(vocab_size=280, show_progress=False))
    bare.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<missing>"}))
    with pytest.raises(ValueError, match="no end-of-document token"):
        Tokenizer(str(model_dir)).identity()
