"""What `shardlab prepare` reads: inputs (text, JSONL, JSON arrays, CSV/TSV, Parquet, `datasets`
folders wherever they are in a tree; compressed or not: data/formats.py decides by content),
cut into pieces that a worker reads on its own, each yielding documents as text.

[Note: pieces] A piece is a small part of one input: about PIECE_BYTES of an uncompressed text
or JSONL file, one Parquet row group, a range of rows of a `datasets` directory, or a whole
compressed file, JSON array or CSV (a stream that cannot be entered in the middle; a compressed
JSONL larger than a unit is cut by prepare's process as it decompresses it instead, into pieces
that carry their bytes: data/units.py). Pieces are planned from sizes and metadata alone, so
planning reads no text, and they depend only on the inputs: the same corpus gives the same
pieces, hence the same tokens, for any --workers and --shard-mb. A file's nominal piece boundary b moves to just after the first newline at or
after b (a JSONL record is never cut); in a text file without a newline within CUT_WINDOW of
b it moves back to the start of the UTF-8 character at b. Both pieces that share a boundary
compute the same cut, so they cover the file exactly once.

A text file is one document (a tokenizer sees it in pieces cut after newlines, so no token
spans a cut); a JSONL line, a JSON array element, a CSV row, a Parquet row or a `datasets` row
is one document (its --field). A UTF-8 byte-order mark at the start of a file is dropped, never
part of a document or a record, and counted (ReplacementCounter.boms). A record that cannot be
read (not JSON, no --field, a field that is not text, a CSV row short of the column) is a bad
record: BadRecords skips and counts it, or stops the prepare (--on-bad-record), and names it by
file and line (JSON arrays: element; Parquet: row group and row).
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from shardlab.data.formats import SUPPORTED, UTF8_BOM, head, open_stream, read_errors, sniff, walk
from shardlab.data.shards import DataError
from shardlab.data.tables import csv_bom, csv_column, csv_rows, dataset_splits, load_dataset_table

PIECE_BYTES = 1 << 20
CUT_WINDOW = 64 << 10
KEEP_LOCATIONS = 5  # bad records and skipped files named in the summary and the manifest


@dataclass(frozen=True)
class Input:
    path: str
    format: str   # text | jsonl | json | csv | tsv | parquet | datasets
    bytes: int    # on disk (compressed, when it is)
    compression: str | None = None  # see data/formats.py

    @property
    def streamed(self) -> bool:
        """Read from start to end in one piece (see [Note: pieces])."""
        return self.compression is not None or self.format in ("json", "csv", "tsv")


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def scan_inputs(specs: list[str], force_format: str | None = None, pool=None,
                splits: list[str] | None = None) -> tuple[list[Input], list[str]]:
    """Files, directories and globs, in the order given, each directory's and glob's files
    sorted, sniffed (data/formats.py; by `pool`'s workers when given): the inputs, and "path:
    reason" for each file skipped as not text. A file named on its own that is not text is an
    error. force_format: read every text file as that format (data.source=text). A `datasets`
    folder (named, or found in a tree: after the files beside it) is an input per split (splits:
    a DatasetDict's to read, default all; data/tables.py)."""
    found: list[tuple[str, bool] | Input] = []
    for spec in specs:
        spec = os.path.expanduser(spec)
        files, named, datasets_dirs = walk(spec)
        if not files and not datasets_dirs:
            raise DataError(f"input {spec!r}: no such file, directory or glob match")
        found += [(f, named) for f in files]
        found += [Input(d, "datasets", _dir_bytes(d)) for dd in datasets_dirs for d in dataset_splits(dd, splits)]
    paths = [f[0] for f in found if not isinstance(f, Input)]
    check = functools.partial(sniff, force_format=force_format)
    sniffed = iter(pool.map(check, paths, chunksize=256) if pool is not None else map(check, paths))
    out: list[Input] = []
    skipped: list[str] = []
    for f in found:
        if isinstance(f, Input):
            out.append(f)
            continue
        (path, named), s = f, next(sniffed)
        if s.not_text is not None:
            if named:
                raise DataError(f"input {path}: not a document ({s.not_text}); prepare reads {SUPPORTED}")
            skipped.append(f"{path}: {s.not_text}")
            continue
        out.append(Input(path, s.format, s.bytes, s.compression))
    return out, skipped


def expand_inputs(specs: list[str], force_format: str | None = None) -> list[Input]:
    """scan_inputs' inputs (the files it skips are not inputs)."""
    return scan_inputs(specs, force_format)[0]


class BadRecords:
    """Records that cannot be read: counted, the first KEEP_LOCATIONS named ("skip"), or an error ("fail")."""

    def __init__(self, mode: str = "skip"):
        self.mode, self.count, self.first = mode, 0, []

    def report(self, where: Callable[[], str], why: str) -> None:
        if self.mode == "fail":
            raise DataError(f"{where()}: {why}; fix or remove the record, or pass --on-bad-record skip to skip "
                            "and count such records")
        self.count += 1
        if len(self.first) < KEEP_LOCATIONS:
            self.first.append(f"{where()}: {why}")


# -- pieces ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    input: int      # index into the inputs
    start: int      # text/jsonl: nominal byte offset; parquet: row group; datasets: first row
    stop: int       # text/jsonl: nominal end offset; parquet: row group + 1; datasets: end row
    bytes: int      # input bytes it stands for (progress, shard sizing)
    first: bool     # holds the start of the input (text: its document's first bytes)
    last: bool      # holds the end of the input (text: where its end-of-document token goes)
    # a piece of a split compressed input (data/units.py): its decompressed bytes and the number
    # of its first line
    data: bytes | None = None
    line: int = 1


def plan_pieces(inputs: list[Input], field: str) -> list[Piece]:
    pieces: list[Piece] = []
    for i, inp in enumerate(inputs):
        if inp.format in ("csv", "tsv"):
            csv_column(inp.path, inp.compression, inp.format, field)  # refused here, before any work
        if inp.streamed:
            pieces.append(Piece(i, 0, inp.bytes, inp.bytes, True, True))
        elif inp.format in ("text", "jsonl"):
            n = max(1, -(-inp.bytes // PIECE_BYTES))
            pieces += [Piece(i, k * PIECE_BYTES, min(inp.bytes, (k + 1) * PIECE_BYTES),
                             min(inp.bytes, (k + 1) * PIECE_BYTES) - k * PIECE_BYTES, k == 0, k == n - 1)
                       for k in range(n)]
        elif inp.format == "parquet":
            meta = _parquet_file(inp.path, field).metadata
            groups = meta.num_row_groups
            pieces += [Piece(i, g, g + 1, meta.row_group(g).total_byte_size, g == 0, g == groups - 1)
                       for g in range(groups)]
        else:
            rows = _datasets_table(inp.path, field).num_rows
            per_row = max(1, inp.bytes // max(1, rows))
            step = max(1, PIECE_BYTES // per_row)
            pieces += [Piece(i, a, min(rows, a + step), (min(rows, a + step) - a) * per_row, a == 0, a + step >= rows)
                       for a in range(0, rows, step)]
    return pieces


def _cut(f, pos: int, size: int, jsonl: bool) -> int:
    """Where a piece boundary nominally at `pos` really is (see [Note: pieces])."""
    if pos <= 0 or pos >= size:
        return max(0, min(pos, size))
    f.seek(pos)
    at = pos
    while True:
        block = f.read(CUT_WINDOW)
        nl = block.find(b"\n")
        if nl >= 0:
            return at + nl + 1
        at += len(block)
        if not block:
            return size
        if not jsonl:  # text without a newline nearby: cut at the UTF-8 character boundary at pos
            f.seek(max(0, pos - 3))
            head = f.read(pos - max(0, pos - 3) + 1)
            back = 0
            while back < 3 and len(head) > back and (head[len(head) - 1 - back] & 0xC0) == 0x80:
                back += 1
            return pos - back


class ReplacementCounter:
    """Decodes UTF-8, replacing each undecodable byte run with U+FFFD, and counts the bytes replaced."""

    NAME = "shardlab-count-replace"
    _current: ReplacementCounter | None = None

    def __init__(self) -> None:
        self.count = 0
        self.boms = 0  # UTF-8 byte-order marks dropped (counted here: every reader has this object)

    def strip_bom(self, raw: bytes) -> bytes:
        if raw.startswith(UTF8_BOM):
            self.boms += 1
            return raw[len(UTF8_BOM):]
        return raw

    @staticmethod
    def _handle(err: UnicodeDecodeError) -> tuple[str, int]:
        ReplacementCounter._current.count += err.end - err.start
        return "\ufffd", err.end

    def decode(self, raw: bytes) -> str:
        ReplacementCounter._current = self
        return raw.decode("utf-8", errors=self.NAME)


codecs.register_error(ReplacementCounter.NAME, ReplacementCounter._handle)


# -- reading documents ----------------------------------------------------------------------------
# What read_piece saw of a file it read from its start, kept (per process, until asked for once)
# so that a small file is opened once, not three times (read, document key, hash)
_HEADS: dict[str, tuple[bytes, bool]] = {}  # path -> (head, whether it is the whole document)
_WHOLE_SHA256: dict[str, str] = {}
HEAD_KEPT = 4096


def document_head(inp: Input, n: int) -> bytes:
    """The first n bytes of a text input's document (decompressed)."""
    kept, whole = _HEADS.pop(inp.path, (None, False))  # its BOM already dropped
    if kept is not None and (len(kept) >= n or whole):
        return kept[:n]
    return head(inp.path, inp.compression, n + 3).removeprefix(UTF8_BOM)[:n]


def whole_file_sha256(path: str) -> str | None:
    """The SHA-256 of a file read whole by read_piece in this process (None: not so read)."""
    return _WHOLE_SHA256.pop(path, None)


def read_piece(inp: Input, piece: Piece, field: str, counter: ReplacementCounter,
               bad: BadRecords | None = None) -> Iterator[tuple[str | None, bytes]]:
    """The piece's documents (or, for text, the parts of its one document, in order) as (text,
    raw UTF-8 bytes when the text decoded without replacement, else b""). text is None for
    ASCII bytes, which need no decoding to be valid UTF-8 (a byte-level prepare then never
    builds the string). Bad records go to `bad` (default: fail)."""
    bad = bad or BadRecords("fail")
    if piece.data is not None:  # cut by the parent from a compressed JSONL file (data/units.py)
        raw = piece.data
        yield from _jsonl_documents(inp.path, piece.start, raw,
                                    lambda at: piece.line + raw.count(b"\n", 0, at - piece.start), field, counter, bad)
    elif inp.streamed:
        yield from _streamed(inp, field, counter, bad)
    elif inp.format in ("text", "jsonl"):
        with open(inp.path, "rb") as f:
            a = _cut(f, piece.start, inp.bytes, inp.format == "jsonl")
            b = _cut(f, piece.stop, inp.bytes, inp.format == "jsonl")
            f.seek(a)
            raw = f.read(max(0, b - a))
        if a == 0:
            if b == inp.bytes:
                _WHOLE_SHA256[inp.path] = hashlib.sha256(raw).hexdigest()
            if inp.format == "text":  # prepare asks for a text document's head (its key) once
                raw = counter.strip_bom(raw)  # (JSONL: _jsonl_documents, which counts lines)
                _HEADS[inp.path] = (raw[:HEAD_KEPT], b == inp.bytes)
        if inp.format == "text":
            if raw and raw.isascii():
                yield None, raw
                return
            before = counter.count
            text = counter.decode(raw)
            yield text, raw if counter.count == before else b""
            return
        yield from _jsonl_documents(inp.path, a, raw, functools.partial(line_number, inp.path), field, counter, bad)
    elif inp.format == "parquet":
        pf = _parquet_file(inp.path, field)
        row = 0
        for batch in pf.iter_batches(batch_size=1024, row_groups=[piece.start], columns=[field]):
            for value in batch.column(0).to_pylist():
                row += 1
                text = _text_of(value, lambda r=row: f"{inp.path}: row group {piece.start}, row {r}", field, bad)
                yield text, b""
    else:
        column = _datasets_table(inp.path, field).column(field).slice(piece.start, piece.stop - piece.start)
        k = piece.start
        for chunk in column.chunks:
            for value in chunk.to_pylist():
                text = _text_of(value, lambda r=k: f"{inp.path}: row {r}", field, bad)
                k += 1
                if text is not None:
                    yield text, b""


def _streamed(inp: Input, field: str, counter: ReplacementCounter, bad: BadRecords):
    """A compressed file or a JSON array, read from its start (see read_piece)."""
    try:
        with open_stream(inp.path, inp.compression) as f:
            if inp.format == "text":
                yield from _text_stream(f, counter)
            elif inp.format == "jsonl":
                for n, line in enumerate(f, 1):
                    text = _record(counter.strip_bom(line) if n == 1 else line, lambda n=n: f"{inp.path}:{n}",
                                   field, counter, bad)
                    if text is not None:
                        yield text, b""
            elif inp.format in ("csv", "tsv"):
                yield from _csv_documents(inp, field, counter, bad)
            else:
                yield from _json_array(inp.path, f, field, counter, bad)
    except read_errors() as e:
        raise damaged(inp, e) from None


def damaged(inp: Input, e: BaseException) -> DataError:
    """The error for an input that cannot be read (e: what reading it raised); a DataError stays itself."""
    if isinstance(e, DataError):
        return e
    return DataError(f"{inp.path}: cannot read it as {inp.compression or 'uncompressed'} {inp.format} ({e}); "
                     "the file is damaged or truncated")


def _csv_documents(inp: Input, field: str, counter: ReplacementCounter, bad: BadRecords):
    counter.boms += csv_bom(inp.path, inp.compression)
    ReplacementCounter._current = counter
    for line, record in csv_rows(inp.path, inp.compression, inp.format, ReplacementCounter.NAME):
        where = functools.partial("{}:{}".format, inp.path, line)
        if field not in record:
            bad.report(where, f"a row of {len(record)} columns, without the {field!r} column")
            continue
        if record[field]:  # an empty cell is an empty record: skipped
            yield record[field], b""


def _text_stream(f, counter: ReplacementCounter):
    decoder = codecs.getincrementaldecoder("utf-8")(ReplacementCounter.NAME)
    first = True
    while True:
        raw = f.read(PIECE_BYTES)
        if first:
            raw, first = counter.strip_bom(raw), False
        if raw and raw.isascii() and decoder.getstate()[0] == b"":
            yield None, raw
            continue
        ReplacementCounter._current = counter
        text = decoder.decode(raw, final=not raw)
        if text:
            yield text, b""
        if not raw:
            return


def _json_array(path: str, f, field: str, counter: ReplacementCounter, bad: BadRecords):
    try:
        records = json.loads(counter.decode(counter.strip_bom(f.read())))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); a .json input is a JSON array of records "
                        "or JSONL") from None
    if not isinstance(records, list):
        raise DataError(f"{path}: a JSON {type(records).__name__}, not an array of records; give JSONL or an array")
    for k, record in enumerate(records):
        where = functools.partial("{}: element {}".format, path, k)
        if not isinstance(record, dict) or field not in record:
            bad.report(where, _no_field(record, field))
            continue
        text = _text_of(record[field], where, field, bad)
        if text is not None:
            yield text, b""


def _no_field(record: Any, field: str) -> str:
    keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
    return f"no field {field!r} in the record (it has {keys}); pass --field NAME"


def _text_of(value: Any, where: Callable[[], str], field: str, bad: BadRecords) -> str | None:
    """A record's text; "" for null (an empty record: skipped); None for a bad record (reported)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        bad.report(where, f"field {field!r} holds {type(value).__name__}, not text; pass --field NAME of a text field")
        return None
    return value


def _record(line: bytes, where: Callable[[], str], field: str, counter: ReplacementCounter,
            bad: BadRecords) -> str | None:
    if not line.strip():
        return None
    try:
        record = json.loads(counter.decode(line))
    except json.JSONDecodeError as e:
        bad.report(where, f"not a JSON line ({e.msg}); JSONL needs one JSON object per line")
        return None
    if not isinstance(record, dict) or field not in record:
        bad.report(where, _no_field(record, field))
        return None
    return _text_of(record[field], where, field, bad)


def _jsonl_documents(path: str, offset: int, raw: bytes, line_at: Callable[[int], int], field: str,
                     counter: ReplacementCounter, bad: BadRecords):
    """The records of `raw`, the lines from byte `offset` of `path`; line_at(offset): its line number."""
    at = offset
    if offset == 0 and raw != (raw := counter.strip_bom(raw)):  # the file's first line
        at = len(UTF8_BOM)
    for line in raw.split(b"\n"):
        where, at = at, at + len(line) + 1
        text = _record(line, lambda w=where: f"{path}:{line_at(w)}", field, counter, bad)
        if text is not None:
            yield text, b""


_LINES_SEEN: dict[str, tuple[int, int]] = {}  # per process: path -> (offset, newlines before it)


def line_number(path: str, offset: int) -> int:
    """The 1-based number of the line that starts at byte `offset` (counted only for a message:
    from the last offset asked about in this file, as a unit's records come in order)."""
    at, lines = _LINES_SEEN.get(path, (0, 0))
    if offset < at:
        at, lines = 0, 0
    with open(path, "rb") as f:
        f.seek(at)
        while at < offset and (block := f.read(min(8 << 20, offset - at))):
            lines += block.count(b"\n")
            at += len(block)
    _LINES_SEEN[path] = (at, lines)
    return lines + 1


_OPENED: dict[Any, Any] = {}  # per process: a worker opens each Parquet file / datasets dir once

def _parquet_file(path: str, field: str):
    if path not in _OPENED:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: Parquet input needs pyarrow: pip install 'shardlab[data]'") from None
        _OPENED[path] = pq.ParquetFile(path)
    pf = _OPENED[path]
    if field not in pf.schema_arrow.names:  # checked at each call: another prepare here may ask for another
        raise DataError(f"{path}: no column {field!r} (columns: {pf.schema_arrow.names[:8]}); pass --field NAME")
    return pf


def _datasets_table(path: str, field: str):
    """A Dataset folder's --field column as a memory-mapped pyarrow Table (data/tables.py)."""
    if (path, field) not in _OPENED:  # a table of that column alone
        _OPENED[path, field] = load_dataset_table(path, [field])
    return _OPENED[path, field]
