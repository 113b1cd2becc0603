"""One worker's unit of `shardlab prepare` (data/prepare.py): its pieces read, cut into
documents, encoded in segments, written as one training shard with its document index, the
held-out documents kept for the val shards, and the inputs it holds whole hashed. `Job` is
what every task carries; `ShardWriter` writes a shard while hashing it.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardlab.data.inputs import (
    BadRecords,
    Input,
    Piece,
    ReplacementCounter,
    document_head,
    read_piece,
    whole_file_sha256,
)
from shardlab.data.shards import INDEX_DTYPE, file_sha256
from shardlab.data.text import Tokenizer

KEY_BYTES = 4096          # the document prefix whose hash decides train or val
ENCODE_BATCH_BYTES = 1 << 20
# A tokenizer encodes text in segments of about this many characters, cut after a newline when
# one lies within SEGMENT_SLACK (else at the limit): `tokenizers` encodes 16 KiB strings 2.5x
# faster than one 1 MiB string (measured here: 5.3 against 2.1 MiB/s on one core).
SEGMENT_CHARS = 16 << 10
SEGMENT_SLACK = 4 << 10


@dataclass(frozen=True)
class Job:
    """The options that shape the output, sent with every task (small: a task carries its own inputs)."""

    field: str
    tokenizer: str | None
    dtype: str
    val_fraction: float
    tmp: str
    on_bad_record: str = "skip"
    dedup: str = "none"  # none | exact


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


def _parts(job: Job, inp: Input, piece: Piece, counter: ReplacementCounter, bad: BadRecords,
           corpus_start: bool) -> Iterator[_Part]:
    if inp.format == "text":  # one document: its key is the file's first bytes, whichever piece this is
        if inp.bytes == 0:
            return  # an empty file is skipped, as an empty record is
        parts = read_piece(inp, piece, job.field, counter, bad)
        prev = next(parts, None)  # first: a small file's head is then known without opening it again
        val = held_out(document_head(inp, KEY_BYTES), job.val_fraction) and piece.input != 0
        for part in parts:  # the document ends after the input's last part
            yield _Part(*prev, val, False)
            prev = part
        if prev is not None:
            yield _Part(*prev, val, piece.last)
        return
    for i, (text, raw) in enumerate(read_piece(inp, piece, job.field, counter, bad)):
        if text:  # an empty record is skipped, not a lone end-of-document token
            first = corpus_start and i == 0
            yield _Part(text, raw, held_out(text.encode("utf-8")[:KEY_BYTES], job.val_fraction) and not first, True)


def run_unit(job: Job, unit: int, pieces: list[Piece], inputs: dict[int, Input]) -> dict[str, Any]:
    """Encode one unit's pieces (of `inputs`, the unit's own) into train shard `train-<unit>`;
    return its manifest entry, the held-out validation tokens (with their document ends), the
    SHA-256 of the inputs the unit holds whole, and counts."""
    tok, counter, bad = _tokenizer(job.tokenizer), ReplacementCounter(), BadRecords(job.on_bad_record)
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

    size, digests, doc_hash = 0, [], None
    for piece in pieces:
        starts_here = piece.first or inputs[piece.input].format != "text"  # else a document begun in another unit
        for part in _parts(job, inputs[piece.input], piece, counter, bad, unit == 0 and piece is pieces[0]):
            if job.dedup == "exact":  # see [Note: exact deduplication]
                if doc_hash is None:
                    doc_hash = hashlib.blake2b(digest_size=16) if starts_here else False
                if doc_hash:
                    doc_hash.update(part.raw or part.text.encode("utf-8"))
                if part.ends:
                    digests.append((part.val, doc_hash.digest() if doc_hash else None))
                    doc_hash = None
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
    whole = {p.input for p in pieces if p.first and p.data is None} & {p.input for p in pieces if p.last}
    return {"unit": unit, "train": train.close(), "documents": documents, "replaced_bytes": counter.count,
            "boms": counter.boms,
            "input_bytes": sum(p.bytes for p in pieces), "bad_records": bad.count, "bad_first": bad.first,
            "hashes": {i: input_sha256(inputs[i]) for i in sorted(whole)}, "digests": digests,
            "val": (np.concatenate(val) if val else np.zeros(0, dtype), val_ends)}


def input_sha256(inp: Input) -> str:
    """An input's SHA-256 (of the file as stored; a `datasets` directory: of its files, in sorted order)."""
    if inp.format != "datasets":
        return whole_file_sha256(inp.path) or file_sha256(inp.path)
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(inp.path)):
        for name in sorted(files):
            h.update(name.encode() + b"\0" + bytes.fromhex(file_sha256(os.path.join(root, name))))
    return h.hexdigest()
