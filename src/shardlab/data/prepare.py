"""`shardlab prepare INPUT... --out DATA_DIR [--tokenizer DIR] [--field NAME] [--workers N]
[--val-fraction F] [--shard-mb M]`: documents to memory-mappable token shards, once.

Inputs are text files, JSONL (one record per line, the text in --field), CSV/TSV and Parquet
(the --field column) and `datasets` folders written by `save_to_disk` (--split chooses a
DatasetDict's splits), mixed as you like: files,
directories and globs as `data.path` takes them (data/inputs.py). The output format and
manifest are in data/shards.py; training maps the result with `data.source=tokens
data.path=DATA_DIR`.

How the work is split: the inputs are cut into pieces of about 1 MiB (data/inputs.py), and
consecutive pieces are grouped into units of about --shard-mb MiB of output (data/units.py, where
a large compressed JSONL is decompressed here and cut for the workers). A worker process
turns one unit into one training shard (data/prepare_unit.py): it reads its pieces, encodes them with the tokenizer
(`tokenizers`' batch encoding, in Rust), writes the shard and its document index, hashes both
and returns the held-out validation documents, which this process writes as the val shards.
Each worker is one core: its Rust threads are limited to one (RAYON_NUM_THREADS, unless you
set it), as the processes fill the cores already. The inputs' SHA-256 are computed by the same
workers. Everything lands in a temporary directory beside DATA_DIR that is renamed to DATA_DIR
last, after manifest.json: an interrupted prepare leaves no DATA_DIR, only a `.NAME.tmp-*`
folder that training refuses (no manifest) and that can be deleted.

Validation: a document is held out when the first 64 bits of the SHA-256 of its first 4 KiB
(UTF-8) fall below --val-fraction of the range; the corpus's first document always trains.
So the split depends on the documents alone, not on --workers, input format or order, and
duplicated documents never straddle train and val.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from shardlab.data.inputs import (
    KEEP_LOCATIONS,
    Input,
    document_head,
    plan_pieces,
    scan_inputs,
)
from shardlab.data.outdir import make_tmp, out_lock, remove_leftovers, write_manifest
from shardlab.data.prepare_unit import Job, ShardWriter, input_sha256, run_unit
from shardlab.data.shards import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_DTYPE,
    MANIFEST,
    TOKENIZER_COPY,
    DataError,
    read_manifest,
    record_verified,
    token_dtype,
)
from shardlab.data.text import Tokenizer, copy_tokenizer_files
from shardlab.data.units import plan_units, unit_target, unit_tasks
from shardlab.data.workers import Workers, doing, init_worker
from shardlab.version import __version__

DEFAULT_VAL_FRACTION = 0.05  # data.val_fraction's default (config.DataConfig): the two agree
def _task(job: Job, task: tuple[str, Any]) -> tuple[str, Any]:
    """("hash", (index, Input)): an input cut across units; ("unit", (unit, pieces, its inputs))."""
    kind, arg = task
    with doing(_code(task)[0]):
        if kind == "hash":
            return kind, (arg[0], input_sha256(arg[1]))
        return kind, run_unit(job, *arg)


# -- the whole corpus -----------------------------------------------------------------------------
def _output_per_input_byte(tok: Tokenizer, inputs: list[Input], dtype: np.dtype) -> float:
    """Shard bytes per input byte: bytes tokens 1:1; a tokenizer's ratio on a sample of the first text."""
    if tok.directory is None:
        return float(dtype.itemsize)
    sample = next((i for i in inputs if i.format in ("text", "jsonl") and i.bytes), None)
    if sample is None:
        return dtype.itemsize / 4.0  # about 4 bytes a token in English
    text = document_head(sample, 256 << 10).decode("utf-8", errors="replace")
    return dtype.itemsize * max(1, len(tok._tok.encode(text, add_special_tokens=False).ids)) / max(1, len(text))


def _code(task: tuple[str, Any]) -> tuple[int, str]:
    """A task's code on the workers' board (data/workers.py) and the inputs it reads."""
    kind, arg = task
    if kind == "hash":
        return -(arg[0] + 1), arg[1].path
    paths = sorted({inp.path for inp in arg[2].values()})
    return arg[0] + 1, ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _results(job: Job, tasks: Iterator[tuple[str, Any]], pool: Workers | None) -> Iterator[tuple[str, Any]]:
    if pool is None:  # here, in this process (the command sets RAYON_NUM_THREADS as a worker would)
        yield from (_task(job, t) for t in tasks)
        return
    # in completion order: a failing unit stops the prepare at once
    yield from pool.imap_unordered(functools.partial(_task, job), tasks, _code)


def _pool_or_none(workers: int):
    """The worker pool (None for one worker: the work runs here), opened before anything here
    has used the tokenizer's threads, and used for the inputs' sniffing too."""
    return Workers(workers) if workers > 1 else contextlib.nullcontext(None)


def prepare(specs: list[str], out: str, *, tokenizer: str | None = None, field: str = "text", workers: int = 1,
            val_fraction: float = 0.0, shard_mb: float = 64.0, force_format: str | None = None,
            progress: bool = True, on_bad_record: str = "skip", dedup: str = "none",
            wait_if_busy: bool = False, splits: list[str] | None = None) -> str:
    """Prepare `specs` into DATA_DIR `out` (see the module docstring); returns `out`.
    wait_if_busy: wait for another prepare into `out` to end (else refuse at once). splits: a
    DatasetDict's splits to read (default all)."""
    if not 0.0 <= val_fraction < 1.0 or shard_mb <= 0 or workers < 1:
        raise DataError("--val-fraction must be in [0, 1), --shard-mb > 0 and --workers >= 1")
    if on_bad_record not in ("skip", "fail"):
        raise DataError(f"--on-bad-record {on_bad_record!r}: choose skip or fail")
    if dedup not in ("none", "exact"):
        raise DataError(f"--dedup {dedup!r}: choose none or exact")
    with out_lock(out, wait_if_busy):
        if os.path.exists(os.path.join(out, MANIFEST)):
            raise DataError(f"--out {out!r} already holds a prepared corpus; delete it or choose another directory")
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise DataError(f"--out {out!r} exists and is not an empty directory; choose another")
        remove_leftovers(out)
        with _pool_or_none(workers) as pool:
            return _prepare_locked(specs, out, pool, tokenizer, field, val_fraction, shard_mb, force_format,
                                   progress, on_bad_record, dedup, splits)


def _prepare_locked(specs: list[str], out: str, pool, tokenizer: str | None, field: str, val_fraction: float,
                    shard_mb: float, force_format: str | None, progress: bool, on_bad_record: str, dedup: str,
                    splits: list[str] | None = None) -> str:
    """prepare, under the lock on `out`, with the worker pool (None: one worker)."""
    inputs, skipped = scan_inputs(specs, force_format, pool, splits)
    tok = Tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    pieces = plan_pieces(inputs, field)
    shard_input_bytes = int(shard_mb * 2**20 / _output_per_input_byte(tok, inputs, dtype))
    layout = plan_units(inputs, pieces, unit_target(pieces, shard_input_bytes), shard_input_bytes)
    tasks = unit_tasks(inputs, layout)  # made as the workers take them (data/units.py)
    job = Job(field, tokenizer, dtype.str, val_fraction, make_tmp(out), on_bad_record, dedup)
    try:
        manifest = _collect(job, tok, tasks, sum(p.bytes for p in pieces), pool, int(shard_mb * 2**20), progress)
        manifest["counts"].update(skipped_files=len(skipped), skipped_files_first=skipped[:KEEP_LOCATIONS])
        manifest.update(inputs=[{"path": i.path, "format": i.format, "compression": i.compression,
                                 "bytes": i.bytes, "sha256": manifest["input_sha256"][k]}
                                for k, i in enumerate(inputs)],
                        field=field, val_fraction=val_fraction, shard_mb=shard_mb, on_bad_record=on_bad_record,
                        dedup=dedup)
        del manifest["input_sha256"]
        if tokenizer is not None:  # the corpus decodes without the original directory (a cluster mount)
            copy_tokenizer_files(tokenizer, os.path.join(job.tmp, TOKENIZER_COPY))
            manifest["tokenizer"]["copy"] = TOKENIZER_COPY
        write_manifest(job.tmp, manifest)
        os.rename(job.tmp, out)  # atomic: DATA_DIR appears complete or not at all
    except BaseException:
        shutil.rmtree(job.tmp, ignore_errors=True)
        raise
    record_verified(read_manifest(out))  # the hashes were computed from what was written
    return out


class _Collector:
    """Takes the units' results in any order and applies them in unit order: the train shards'
    order, the validation shards' content, and the first bad records named do not depend on
    which worker finished first."""

    def __init__(self, job: Job, shard_bytes: int):
        self.job, self.shard_bytes, self.dtype = job, shard_bytes, np.dtype(job.dtype)
        self.pending: dict[int, dict] = {}
        self.next_unit = 0
        self.train: list[dict] = []
        self.val_shards: list[dict] = []
        self.val = ShardWriter(job.tmp, "val-00000", self.dtype)
        self.counts = {"documents": 0, "replaced_invalid_utf8_bytes": 0, "byte_order_marks": 0, "input_bytes": 0,
                       "bad_records": 0, "bad_records_first": []}
        self.hashes: dict[int, str] = {}
        self.tokens = 0
        self.seen: set[bytes] = set()  # document hashes, --dedup exact
        if job.dedup == "exact":
            self.counts["duplicates"] = 0

    def add(self, r: dict) -> None:
        self.pending[r["unit"]] = r
        while self.next_unit in self.pending:
            self._apply(self.pending.pop(self.next_unit))
            self.next_unit += 1

    def _apply(self, r: dict) -> None:
        if self.job.dedup == "exact":
            self._drop_duplicates(r)
        if r["train"] is not None:
            self.train.append(r["train"])
            self.tokens += r["train"]["tokens"]
        val_ids, val_ends = r["val"]
        for end in val_ends:
            self.val.ends.append(self.val.tokens + end)
        self.val.write(val_ids)
        self.tokens += len(val_ids)
        if self.val.tokens * self.dtype.itemsize >= self.shard_bytes:
            self.val_shards.append(self.val.close())
            self.val = ShardWriter(self.job.tmp, f"val-{len(self.val_shards):05d}", self.dtype)
        c = self.counts
        c["documents"] += r["documents"]
        c["replaced_invalid_utf8_bytes"] += r["replaced_bytes"]
        c["byte_order_marks"] += r["boms"]
        c["input_bytes"] += r["input_bytes"]
        c["bad_records"] += r["bad_records"]
        c["bad_records_first"] = (c["bad_records_first"] + r["bad_first"])[:KEEP_LOCATIONS]
        self.hashes.update(r["hashes"])

    def _drop_duplicates(self, r: dict) -> None:
        """[Note: exact deduplication] A unit reports a 128-bit BLAKE2b of every document that
        ends in it, in order (None for a text file begun in an earlier unit: its head is already
        written, so it is kept). Applied in unit order, a document whose hash was seen before is
        dropped: the first copy in corpus order stays, whatever --workers. The unit's train shard
        is rewritten without the dropped documents, its held-out ones are left out here."""
        drop = {False: set(), True: set()}
        k = {False: 0, True: 0}
        for is_val, digest in r["digests"]:
            if digest is not None and digest in self.seen:
                drop[is_val].add(k[is_val])
            elif digest is not None:
                self.seen.add(digest)
            k[is_val] += 1
        dropped = len(drop[False]) + len(drop[True])
        if not dropped:
            return
        self.counts["duplicates"] += dropped
        r["documents"] -= dropped
        if drop[False] and r["train"] is not None:
            name = r["train"]["bin"]["name"][:-4]
            ids = np.fromfile(os.path.join(self.job.tmp, f"{name}.bin"), dtype=self.dtype)
            ends = np.fromfile(os.path.join(self.job.tmp, f"{name}.idx"), dtype=INDEX_DTYPE)
            os.remove(os.path.join(self.job.tmp, f"{name}.idx"))
            w = ShardWriter(self.job.tmp, name, self.dtype)
            for d, (a, b) in enumerate(zip([0, *ends[:-1]], ends)):
                if d not in drop[False]:
                    w.write(ids[a:b])
                    w.end_document()
            w.write(ids[int(ends[-1]) if len(ends) else 0:])  # a text file that goes on in the next unit
            r["train"] = w.close()
        if drop[True]:
            ids, ends = r["val"]
            kept, kept_ends = [], []
            for d, (a, b) in enumerate(zip([0, *ends[:-1]], ends)):
                if d not in drop[True]:
                    kept.append(ids[a:b])
                    kept_ends.append(sum(len(x) for x in kept))
            r["val"] = (np.concatenate(kept) if kept else ids[:0], kept_ends)

    def close(self) -> None:
        last = self.val.close()
        self.val_shards += [last] if last is not None else []


def _collect(job: Job, tok: Tokenizer, tasks: Iterator[tuple[str, Any]], total: int, pool, shard_bytes: int,
             progress: bool) -> dict:
    """Run the tasks (total: their input bytes); write the validation shards here as units
    return; the manifest's body."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="prepare", dynamic_ncols=True,
               disable=None if progress else True)
    c = _Collector(job, shard_bytes)
    t0 = time.perf_counter()
    try:
        for kind, r in _results(job, tasks, pool):
            if kind == "hash":
                c.hashes[r[0]] = r[1]
                continue
            c.add(r)
            bar.update(r["input_bytes"])
            bar.set_postfix_str(f"{c.tokens / max(1e-9, time.perf_counter() - t0):,.0f} tok/s")
    finally:
        c.close()
        bar.close()
    splits = {name: {"tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
                     "shards": shards} for name, shards in (("train", c.train), ("val", c.val_shards))}
    if splits["train"]["tokens"] == 0 and c.counts["bad_records"]:
        raise DataError(f"every record was bad ({c.counts['bad_records']} skipped; the first: "
                        f"{c.counts['bad_records_first'][0]})")
    if splits["train"]["tokens"] == 0:
        raise DataError("the inputs hold no text (an empty corpus)" if c.counts["documents"] == 0 else
                        "every document went to the validation split; lower --val-fraction or give more documents")
    return {"format": FORMAT, "version": FORMAT_VERSION, "shardlab_version": __version__,
            "tokenizer": tok.identity(), "dtype": np.dtype(job.dtype).name, "byte_order": "little",
            "counts": c.counts, "splits": splits, "input_sha256": [c.hashes[i] for i in range(len(c.hashes))]}


# -- the command ----------------------------------------------------------------------------------
def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text/JSONL/CSV/Parquet files, directories, globs, datasets save_to_disk folders")
    p.add_argument("--out", required=True, metavar="DATA_DIR", help="the directory to create (must not exist)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a local directory with tokenizer.json (an HF model directory works); default: bytes")
    p.add_argument("--field", default="text", metavar="NAME",
                   help="JSONL/CSV/Parquet/datasets text field or column (default text)")
    p.add_argument("--split", default=None, metavar="NAME[,NAME]",
                   help="a datasets DatasetDict folder's splits to read (default: every split)")
    p.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                   help=f"worker processes, one core each (default: the usable cores, {default_workers()} here)")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, metavar="F",
                   help="held-out documents for validation, as a fraction (default "
                        f"{DEFAULT_VAL_FRACTION}, as data.val_fraction)")
    p.add_argument("--shard-mb", type=float, default=64.0, metavar="M", help="about M MiB per shard (default 64)")
    p.add_argument("--on-bad-record", choices=("skip", "fail"), default="skip",
                   help="a JSONL/JSON/Parquet record without a text --field: skip and count it (default) or stop")
    p.add_argument("--dedup", choices=("none", "exact"), default="none",
                   help="exact: drop documents identical to an earlier one (whole-document hashes), counted")


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    init_worker()  # --workers 1 encodes in this process: one core too
    signal.signal(signal.SIGTERM, _raise_interrupt)  # as Ctrl-C: the partial output is removed
    if hasattr(signal, "SIGUSR1"):  # kill -USR1 PID: every thread's stack, here and in the workers (forked after)
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        out = prepare(args.inputs, args.out, tokenizer=args.tokenizer, field=args.field, workers=args.workers,
                      val_fraction=args.val_fraction, shard_mb=args.shard_mb, on_bad_record=args.on_bad_record,
                      dedup=args.dedup, splits=args.split.split(",") if getattr(args, "split", None) else None)
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"prepare: interrupted; nothing was written to {args.out} (its partial output was removed)",
              file=sys.stderr)
        return 130
    m = read_manifest(out).raw
    secs = time.perf_counter() - t0
    c = m["counts"]
    mib = c["input_bytes"] / 2**20
    print(f"prepared {mib:.1f} MiB in {secs:.1f} s ({mib / secs:.1f} MiB/s, {args.workers} worker(s)): "
          f"{m['splits']['train']['tokens']:,} train and {m['splits']['val']['tokens']:,} val tokens "
          f"({m['dtype']}, vocab {m['tokenizer']['vocab_size']}), {c['documents']:,} documents, "
          f"{c['replaced_invalid_utf8_bytes']} invalid UTF-8 bytes replaced -> {out}")
    if c.get("byte_order_marks"):
        print(f"dropped {c['byte_order_marks']:,} UTF-8 byte-order mark(s) at the start of files (not text)")
    if "duplicates" in c:
        print(f"dropped {c['duplicates']:,} duplicate documents (--dedup exact)")
    for what, n, first in (("bad records", c["bad_records"], c["bad_records_first"]),
                           ("files that are not text", c["skipped_files"], c["skipped_files_first"])):
        if n:
            print(f"skipped {n:,} {what}, first: " + "; ".join(first))
    print(f"train on it: shardlab train CONFIG data.source=tokens data.path={out}")
    return 0
