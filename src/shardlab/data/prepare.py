"""`shardlab prepare INPUT... --out DATA_DIR [--tokenizer DIR] [--field NAME] [--workers N]
[--val-fraction F] [--shard-mb M]`: documents to memory-mappable token shards, once.

Inputs are text files, JSONL (one record per line, the text in --field), Parquet (the --field
column) and `datasets` directories written by `save_to_disk`, mixed as you like: files,
directories and globs as `data.path` takes them (data/inputs.py). The output format and
manifest are in data/shards.py; training maps the result with `data.source=tokens
data.path=DATA_DIR`.

How the work is split: the inputs are cut into pieces of about 1 MiB (data/inputs.py), and
consecutive pieces are grouped into units of about --shard-mb MiB of output. A worker process
turns one unit into one training shard: it reads its pieces, encodes them with the tokenizer
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
import functools
import hashlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardlab.data.inputs import Input, Piece, ReplacementCounter, expand_inputs, plan_pieces, read_piece
from shardlab.data.shards import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_DTYPE,
    MANIFEST,
    TOKENIZER_COPY,
    DataError,
    file_sha256,
    read_manifest,
    record_verified,
    token_dtype,
)
from shardlab.data.text import Tokenizer, copy_tokenizer_files

KEY_BYTES = 4096          # the document prefix whose hash decides train or val
ENCODE_BATCH_BYTES = 1 << 20
# A tokenizer encodes text in segments of about this many characters, cut after a newline when
# one lies within SEGMENT_SLACK (else at the limit): `tokenizers` encodes 16 KiB strings 2.5x
# faster than one 1 MiB string (measured here: 5.3 against 2.1 MiB/s on one core).
SEGMENT_CHARS = 16 << 10
SEGMENT_SLACK = 4 << 10


@dataclass(frozen=True)
class Job:
    """What every worker needs (picklable): the inputs and the options that shape the output."""

    inputs: tuple[Input, ...]
    field: str
    tokenizer: str | None
    dtype: str
    val_fraction: float
    tmp: str


class ShardWriter:
    """Streams tokens to <prefix>.bin, hashing as it writes; <prefix>.idx gets the document ends."""

    def __init__(self, tmp: str, name: str, dtype: np.dtype):
        self.tmp, self.name, self.dtype = tmp, name, dtype
        self.f = open(os.path.join(tmp, f"{name}.bin"), "wb")
        self.h = hashlib.sha256()
        self.tokens = 0
        self.ends: list[int] = []

    def write(self, ids: np.ndarray) -> None:
        block = memoryview(np.ascontiguousarray(ids, dtype=self.dtype)).cast("B")
        self.f.write(block)
        self.h.update(block)
        self.tokens += len(ids)

    def end_document(self) -> None:
        self.ends.append(self.tokens)

    def close(self) -> dict[str, Any] | None:
        """The shard's manifest entry (None, and no files, when it holds no token)."""
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        bin_path = os.path.join(self.tmp, f"{self.name}.bin")
        if self.tokens == 0:
            os.remove(bin_path)
            return None
        idx = np.asarray(self.ends, dtype=INDEX_DTYPE).tobytes()
        with open(os.path.join(self.tmp, f"{self.name}.idx"), "wb") as f:
            f.write(idx)
            f.flush()
            os.fsync(f.fileno())
        return {"tokens": self.tokens, "documents": len(self.ends),
                "bin": {"name": f"{self.name}.bin", "bytes": self.tokens * self.dtype.itemsize,
                        "sha256": self.h.hexdigest()},
                "idx": {"name": f"{self.name}.idx", "bytes": len(idx), "sha256": hashlib.sha256(idx).hexdigest()}}


# -- one worker's unit ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def _tokenizer(directory: str | None) -> Tokenizer:
    return Tokenizer(directory)


def segments(text: str) -> list[str]:
    """`text` cut for encoding (see SEGMENT_CHARS); a token never spans a cut."""
    out, at = [], 0
    while len(text) - at > SEGMENT_CHARS + SEGMENT_SLACK:
        nl = text.find("\n", at + SEGMENT_CHARS, at + SEGMENT_CHARS + SEGMENT_SLACK)
        cut = nl + 1 if nl >= 0 else at + SEGMENT_CHARS
        out.append(text[at:cut])
        at = cut
    out.append(text[at:])
    return out


def held_out(key: bytes, val_fraction: float) -> bool:
    return val_fraction > 0 and int.from_bytes(hashlib.sha256(key).digest()[:8], "big") < val_fraction * 2**64


@dataclass
class _Part:
    """Text of one document, or of one piece of a text file's document."""

    text: str | None  # None: ASCII, `raw` is the text (see inputs.read_piece)
    raw: bytes
    val: bool
    ends: bool  # the document ends here: its end-of-document token follows


def _parts(job: Job, piece: Piece, counter: ReplacementCounter, corpus_start: bool) -> Iterator[_Part]:
    inp = job.inputs[piece.input]
    if inp.format == "text":  # one document: its key is the file's first bytes, whichever piece this is
        if inp.bytes == 0:
            return  # an empty file is skipped, as an empty record is
        with open(inp.path, "rb") as f:
            key = f.read(KEY_BYTES)
        val = held_out(key, job.val_fraction) and piece.input != 0
        for text, raw in read_piece(inp, piece, job.field, counter):
            yield _Part(text, raw, val, piece.last)
        return
    for i, (text, raw) in enumerate(read_piece(inp, piece, job.field, counter)):
        if text:  # an empty record is skipped, not a lone end-of-document token
            first = corpus_start and i == 0
            yield _Part(text, raw, held_out(text.encode("utf-8")[:KEY_BYTES], job.val_fraction) and not first, True)


def run_unit(job: Job, unit: int, pieces: list[Piece]) -> dict[str, Any]:
    """Encode one unit's pieces into train shard `train-<unit>`; return its manifest entry, the
    held-out validation tokens (with their document ends) and counts."""
    tok, counter = _tokenizer(job.tokenizer), ReplacementCounter()
    dtype, eod = np.dtype(job.dtype), np.asarray([tok.eod_id], dtype=np.uint32)
    train = ShardWriter(job.tmp, f"train-{unit:05d}", dtype)
    val: list[np.ndarray] = []
    val_tokens, val_ends, documents = 0, [], 0
    batch: list[_Part] = []

    def flush() -> None:
        nonlocal val_tokens, documents
        for part, ids in zip(batch, tok.encode_batch([p.text for p in batch], [p.raw for p in batch])):
            if part.val:
                val.append(np.concatenate([ids, eod]).astype(dtype) if part.ends else ids.astype(dtype))
                val_tokens += len(ids) + part.ends
                if part.ends:
                    val_ends.append(val_tokens)
            else:
                train.write(ids)
                if part.ends:
                    train.write(eod)
                    train.end_document()
            documents += part.ends
        batch.clear()

    size = 0
    for piece in pieces:
        for part in _parts(job, piece, counter, unit == 0 and piece is pieces[0]):
            if tok.directory is None:
                cuts = [part.text]
            else:
                cuts = segments(part.text if part.text is not None else part.raw.decode("ascii"))
            for k, text in enumerate(cuts):
                ends = part.ends and k == len(cuts) - 1
                batch.append(_Part(text, part.raw if len(cuts) == 1 else b"", part.val, ends))
            size += len(part.raw) or len(part.text)
            if size >= ENCODE_BATCH_BYTES:
                flush()
                size = 0
    flush()
    return {"unit": unit, "train": train.close(), "documents": documents, "replaced_bytes": counter.count,
            "input_bytes": sum(p.bytes for p in pieces),
            "val": (np.concatenate(val) if val else np.zeros(0, dtype), val_ends)}


def _task(job: Job, task: tuple[str, Any]) -> tuple[str, Any]:
    kind, arg = task
    if kind == "hash":  # an input's SHA-256 (a `datasets` directory: of its files, in sorted order)
        inp = job.inputs[arg]
        if inp.format != "datasets":
            return kind, (arg, file_sha256(inp.path))
        h = hashlib.sha256()
        for root, _, files in sorted(os.walk(inp.path)):
            for name in sorted(files):
                h.update(name.encode() + b"\0" + bytes.fromhex(file_sha256(os.path.join(root, name))))
        return kind, (arg, h.hexdigest())
    return kind, run_unit(job, *arg)


def _init_worker() -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one core per worker (see the module docstring)


# -- the whole corpus -----------------------------------------------------------------------------
def group_units(pieces: list[Piece], target_input_bytes: int) -> list[list[Piece]]:
    units: list[list[Piece]] = [[]]
    size = 0
    for p in pieces:
        if units[-1] and size + p.bytes > target_input_bytes:
            units.append([])
            size = 0
        units[-1].append(p)
        size += p.bytes
    return [u for u in units if u]


def _output_per_input_byte(tok: Tokenizer, inputs: list[Input], dtype: np.dtype) -> float:
    """Shard bytes per input byte: bytes tokens 1:1; a tokenizer's ratio on a sample of the first text."""
    if tok.directory is None:
        return float(dtype.itemsize)
    sample = next((i for i in inputs if i.format in ("text", "jsonl") and i.bytes), None)
    if sample is None:
        return dtype.itemsize / 4.0  # about 4 bytes a token in English
    with open(sample.path, "rb") as f:
        text = f.read(256 << 10).decode("utf-8", errors="replace")
    return dtype.itemsize * max(1, len(tok._tok.encode(text, add_special_tokens=False).ids)) / max(1, len(text))


def _pool(workers: int):
    # fork: nothing here has used the tokenizer's Rust threads, so the children start clean and fast
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    return ctx.Pool(workers, initializer=_init_worker)


def _results(job: Job, tasks: list[tuple[str, Any]], workers: int) -> Iterator[tuple[str, Any]]:
    if workers <= 1:  # here, in this process (the command sets RAYON_NUM_THREADS as a worker would)
        yield from (_task(job, t) for t in tasks)
        return
    with _pool(workers) as pool:
        yield from pool.imap(functools.partial(_task, job), tasks, chunksize=1)


def prepare(specs: list[str], out: str, *, tokenizer: str | None = None, field: str = "text", workers: int = 1,
            val_fraction: float = 0.0, shard_mb: float = 64.0, force_format: str | None = None,
            progress: bool = True) -> str:
    """Prepare `specs` into DATA_DIR `out` (see the module docstring); returns `out`."""
    if os.path.exists(os.path.join(out, MANIFEST)):
        raise DataError(f"--out {out!r} already holds a prepared corpus; delete it or choose another directory")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise DataError(f"--out {out!r} exists and is not an empty directory; choose another")
    if not 0.0 <= val_fraction < 1.0 or shard_mb <= 0 or workers < 1:
        raise DataError("--val-fraction must be in [0, 1), --shard-mb > 0 and --workers >= 1")
    inputs = expand_inputs(specs, force_format)
    tok = Tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    pieces = plan_pieces(inputs, field)
    target = max(1, int(shard_mb * 2**20 / _output_per_input_byte(tok, inputs, dtype)))
    units = group_units(pieces, target)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(os.path.abspath(out))}.tmp-")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the corpus from other users of a shared mount
    job = Job(tuple(inputs), field, tokenizer, dtype.str, val_fraction, tmp)
    try:
        tasks = [("hash", i) for i in range(len(inputs))] + [("unit", (u, ps)) for u, ps in enumerate(units)]
        manifest = _collect(job, tok, tasks, workers, int(shard_mb * 2**20), progress)
        manifest.update(inputs=[{"path": i.path, "format": i.format, "bytes": i.bytes, "sha256": h}
                                for i, h in zip(inputs, manifest.pop("input_sha256"))],
                        field=field, val_fraction=val_fraction, shard_mb=shard_mb)
        if tokenizer is not None:  # the corpus decodes without the original directory (a cluster mount)
            copy_tokenizer_files(tokenizer, os.path.join(tmp, TOKENIZER_COPY))
            manifest["tokenizer"]["copy"] = TOKENIZER_COPY
        _write_manifest(tmp, manifest)
        os.rename(tmp, out)  # atomic: DATA_DIR appears complete or not at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    record_verified(read_manifest(out))  # the hashes were computed from what was written
    return out


def _collect(job: Job, tok: Tokenizer, tasks: list, workers: int, shard_bytes: int, progress: bool) -> dict:
    """Run the tasks; write the validation shards here as units return; the manifest's body."""
    from tqdm import tqdm

    dtype = np.dtype(job.dtype)
    total = sum(sum(p.bytes for p in arg[1]) for kind, arg in tasks if kind == "unit")
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="prepare", dynamic_ncols=True,
               disable=None if progress else True)
    hashes: dict[int, str] = {}
    train: list[dict] = []
    val_shards: list[dict] = []
    val = ShardWriter(job.tmp, "val-00000", dtype)
    counts = {"documents": 0, "replaced_invalid_utf8_bytes": 0, "input_bytes": 0}
    t0, tokens = time.perf_counter(), 0
    try:
        for kind, r in _results(job, tasks, workers):
            if kind == "hash":
                hashes[r[0]] = r[1]
                continue
            if r["train"] is not None:
                train.append(r["train"])
                tokens += r["train"]["tokens"]
            val_ids, val_ends = r["val"]
            for end in val_ends:
                val.ends.append(val.tokens + end)
            val.write(val_ids)
            tokens += len(val_ids)
            if val.tokens * dtype.itemsize >= shard_bytes:
                val_shards.append(val.close())
                val = ShardWriter(job.tmp, f"val-{len(val_shards):05d}", dtype)
            counts["documents"] += r["documents"]
            counts["replaced_invalid_utf8_bytes"] += r["replaced_bytes"]
            counts["input_bytes"] += r["input_bytes"]
            bar.update(r["input_bytes"])
            bar.set_postfix_str(f"{tokens / max(1e-9, time.perf_counter() - t0):,.0f} tok/s")
    finally:
        last = val.close()
        bar.close()
    val_shards += [last] if last is not None else []
    splits = {name: {"tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
                     "shards": shards} for name, shards in (("train", train), ("val", val_shards))}
    if splits["train"]["tokens"] == 0:
        raise DataError("the inputs hold no text (an empty corpus)" if counts["documents"] == 0 else
                        "every document went to the validation split; lower --val-fraction or give more documents")
    import shardlab

    return {"format": FORMAT, "version": FORMAT_VERSION, "shardlab_version": shardlab.__version__,
            "tokenizer": tok.identity(), "dtype": dtype.name, "byte_order": "little", "counts": counts,
            "splits": splits, "input_sha256": [hashes[i] for i in range(len(job.inputs))]}


def _write_manifest(tmp: str, manifest: dict) -> None:
    import json

    path = os.path.join(tmp, MANIFEST)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the command ----------------------------------------------------------------------------------
def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text/JSONL/Parquet files, directories, globs, or a datasets save_to_disk directory")
    p.add_argument("--out", required=True, metavar="DATA_DIR", help="the directory to create (must not exist)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a local directory with tokenizer.json (an HF model directory works); default: bytes")
    p.add_argument("--field", default="text", metavar="NAME", help="JSONL/Parquet/datasets text field (default text)")
    p.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                   help=f"worker processes, one core each (default: the usable cores, {default_workers()} here)")
    p.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                   help="held-out documents for validation, as a fraction (default 0)")
    p.add_argument("--shard-mb", type=float, default=64.0, metavar="M", help="about M MiB per shard (default 64)")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    _init_worker()  # --workers 1 encodes in this process: one core too
    try:
        out = prepare(args.inputs, args.out, tokenizer=args.tokenizer, field=args.field, workers=args.workers,
                      val_fraction=args.val_fraction, shard_mb=args.shard_mb)
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = read_manifest(out).raw
    secs = time.perf_counter() - t0
    mib = m["counts"]["input_bytes"] / 2**20
    print(f"prepared {mib:.1f} MiB in {secs:.1f} s ({mib / secs:.1f} MiB/s, {args.workers} worker(s)): "
          f"{m['splits']['train']['tokens']:,} train and {m['splits']['val']['tokens']:,} val tokens "
          f"({m['dtype']}, vocab {m['tokenizer']['vocab_size']}), {m['counts']['documents']:,} documents, "
          f"{m['counts']['replaced_invalid_utf8_bytes']} invalid UTF-8 bytes replaced -> {out}")
    print(f"train on it: shardlab train CONFIG data.source=tokens data.path={out}")
    return 0
