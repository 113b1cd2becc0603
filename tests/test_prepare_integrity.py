"""A prepared corpus is never silently wrong: an edited manifest is refused at the start checks,
old uint16 byte corpora still read, concurrent and interrupted prepares leave nothing behind
and say what happened (data/shards.py, data/prepare.py)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from shardlab.data.prepare import out_lock, prepare
from shardlab.data.shards import DataError, read_manifest
from shardlab.data.tokens import check
from tests.test_prepare import DOCS, _cfg, as_text_files, stream, words


def _edit_manifest(path: str, edit) -> None:
    p = os.path.join(path, "manifest.json")
    raw = json.loads(open(p).read())
    edit(raw)
    with open(p, "w") as f:
        json.dump(raw, f)


def test_an_edited_manifest_is_one_line_error_at_the_start_checks(tmp_path):
    src = as_text_files(tmp_path, DOCS)
    cases = {
        "tokens": (lambda m: m["splits"]["train"]["shards"][0].update(tokens=m["splits"]["train"]["shards"][0]
                                                                         ["tokens"] + 64), "make .* bytes"),
        "split": (lambda m: m["splits"]["train"].update(tokens=10**9), "splits.train.tokens"),
        "dtype": (lambda m: m.update(dtype="float32"), "dtype 'float32'"),
        "vocab": (lambda m: m["tokenizer"].update(vocab_size=70000), "does not fit dtype uint8"),
        "name": (lambda m: m["splits"]["train"]["shards"][0]["bin"].update(name="../x.bin"), "not plain names"),
        "missing": (lambda m: m.pop("splits"), "missing or malformed"),
    }
    for name, (edit, expect) in cases.items():
        path = prepare([src], str(tmp_path / name))
        check(_cfg(path))
        _edit_manifest(path, edit)
        with pytest.raises(DataError, match=f"manifest.json: .*{expect}.*prepare the corpus again") as e:
            check(_cfg(path))
        assert "\n" not in str(e.value), name


def test_uint16_byte_corpora_of_before_still_read(tmp_path):
    path = prepare([as_text_files(tmp_path, DOCS)], str(tmp_path / "out"))
    tokens = stream(path)

    def widen(m):  # rewrite every shard as the uint16 of before
        m["dtype"] = "uint16"
        for split in ("train", "val"):
            for shard in m["splits"][split]["shards"]:
                f = os.path.join(path, shard["bin"]["name"])
                wide = np.fromfile(f, dtype=np.uint8).astype("<u2").tobytes()
                open(f, "wb").write(wide)
                shard["bin"].update(bytes=len(wide), sha256=hashlib.sha256(wide).hexdigest())

    _edit_manifest(path, widen)
    check(_cfg(path))
    assert stream(path) == tokens


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(") ")[1][0] not in "ZX"
    except OSError:
        return False


def _start(tmp_path, corpus, out, workers: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "shardlab", "prepare", str(corpus), "--out", str(out),
                             "--workers", str(workers), "--shard-mb", "0.25"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(p.name.startswith(f".{out.name}.tmp-") and any(p.glob("train-*.bin"))
                                                  for p in tmp_path.iterdir()):
        time.sleep(0.005)
    return proc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_busy_out_killed_and_terminated_prepares(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text(words(1 << 20, 3) * 256)  # 256 MiB (a few s): each signal lands well before the end
    out = tmp_path / "data"
    proc = _start(tmp_path, corpus, out, workers=2)
    t0 = time.monotonic()
    with pytest.raises(DataError, match=rf"another prepare \(pid {proc.pid}\) is writing it"):
        prepare([str(corpus)], str(out))  # refused at its start, not after its work
    assert time.monotonic() - t0 < 1
    workers = _children(proc.pid)
    assert len(workers) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.05)
    assert not any(_alive(w) for w in workers)  # the pool died with its parent
    leftover = [p for p in tmp_path.iterdir() if p.name.startswith(".data.tmp-")]
    assert leftover and not out.exists()
    with pytest.raises(DataError, match="no such file"):  # the next prepare, whatever its fate, cleans up
        prepare([str(tmp_path / "missing")], str(out))
    assert f"removing {leftover[0]}, the partial output of an interrupted prepare" in capsys.readouterr().err
    assert not leftover[0].exists()

    proc = _start(tmp_path, corpus, out, workers=1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("prepare: interrupted; nothing was written")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".data.")]


def test_a_held_lock_refuses_and_a_free_one_is_taken(tmp_path):
    out = str(tmp_path / "out")
    with out_lock(out, wait=False):
        with pytest.raises(DataError, match="another prepare"):
            prepare([as_text_files(tmp_path, DOCS)], out)
    prepare([str(tmp_path / "txt")], out)
    assert read_manifest(out).raw["counts"]["documents"] == len(DOCS)
    assert not os.path.exists(os.path.join(tmp_path, ".out.lock"))


def test_a_cache_being_prepared_elsewhere_is_waited_for(tmp_path, monkeypatch):
    """data.source=text prepares into the cache; two processes of one machine may do it at once (the
    local rank 0 of each agent of a job): the second waits for the first's corpus, not refused."""
    import threading

    from shardlab.config import load_config
    from shardlab.data.tokens import cached_data_dir

    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "cache"))
    cfg = load_config(None, ["data.source=text", f"data.path={as_text_files(tmp_path, DOCS)}", "data.seq_len=16",
                             "train.global_batch_size=4", "train.micro_batch_size=2"])
    out = cached_data_dir(cfg, prepare_if_missing=False)
    got = []
    with out_lock(out, wait=False):  # another process is preparing it
        waiter = threading.Thread(target=lambda: got.append(cached_data_dir(cfg)))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not got  # it waits, it is not refused
        prepare([str(tmp_path / "txt")], out + ".first", force_format="text")
        os.replace(out + ".first", out)  # the first's corpus in place, then its lock released
    waiter.join(30)
    assert got == [out] and read_manifest(out).raw["counts"]["documents"] == len(DOCS)


def test_advice_for_raw_folders_tokenizer_files_and_hub_names(tmp_path):
    from shardlab.data.text import Tokenizer

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")

    raw = as_text_files(tmp_path, DOCS[:2])
    with pytest.raises(DataError, match=rf"prepare them: `shardlab prepare {raw} --out {raw}-tokens`"):
        check(_cfg(raw))
    with pytest.raises(ValueError, match=f"is a file; pass the directory that holds it: {tmp_path / 'tok'}$"):
        Tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    with pytest.raises(ValueError, match="nothing is fetched from a hub"):
        Tokenizer("gpt2")


def test_a_corpus_without_a_split_says_so_and_can_hold_out_train_windows(tmp_path, capsys):
    from shardlab.data import build_datasets

    path = prepare([as_text_files(tmp_path, DOCS)], str(tmp_path / "out"), val_fraction=0.0)
    d = build_datasets(_cfg(path))
    assert d.val is None
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "has no validation split" in said[0] and "data.val_from_train=true" in said[0]
    held = build_datasets(_cfg(path, "data.val_from_train=true", "data.val_fraction=0.25"))
    n = len(d.train)
    assert len(held.val) == int(n * 0.25) and len(held.train) + len(held.val) == n
    assert [t.tolist() for t in held.val[0]] == [t.tolist() for t in d.train[len(held.train)]]
    from shardlab.config import DataConfig
    from shardlab.data.prepare import DEFAULT_VAL_FRACTION

    assert DEFAULT_VAL_FRACTION == DataConfig.val_fraction  # prepare's default is data.val_fraction's
