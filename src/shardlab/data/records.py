"""Whole records (dicts) from what `shardlab prepare` reads, for data.source=sft (data/sft.py):
files, folders and globs as prepare takes them (data/inputs.py scans them; data/formats.py
decides compression and format by content), each input read in order:

    JSONL (any text file; .json whose first character is `[`: a JSON array), compressed or not
    Parquet (every column: a `messages` column of role/content structs comes out as a list of dicts)
    `datasets` save_to_disk folders (a Dataset, or a DatasetDict of one split: of several, the
    error names them, as training on a test split would be silently wrong; pyarrow only)
    CSV/TSV with a header row (each row a record of its columns)

Each record comes with where it is, "FILE:LINE" or "FILE: row N", for messages; a record that
cannot be read (not JSON, not UTF-8, a damaged file) is an error naming its file and line: SFT
examples are few and precious, so nothing is skipped silently.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

from shardlab.data.formats import UTF8_BOM, open_stream, read_errors, walk
from shardlab.data.inputs import Input, damaged, scan_inputs
from shardlab.data.shards import DataError, file_sha256
from shardlab.data.tables import csv_rows, dataset_splits, load_dataset_table

BATCH_ROWS = 1024


def scan(spec: str) -> list[Input]:
    """The inputs of data.path; a file that is not text (or is UTF-16) is refused, named."""
    for found in walk(os.path.expanduser(spec))[2]:
        splits = dataset_splits(found, None)
        if len(splits) > 1:
            names = [os.path.basename(s) for s in splits]
            raise DataError(f"{found}: a DatasetDict of splits {names}; give the one to train on: "
                            f"data.path={splits[0]}")
    inputs, skipped = scan_inputs([spec])
    if not inputs:
        raise DataError(f"{spec}: no readable file in it ({'; '.join(skipped[:3])})")
    return inputs


def sha256(inputs: list[Input]) -> str:
    """The inputs' content hash: a single file's own SHA-256, else one over theirs, in order."""
    from shardlab.data.prepare import input_sha256

    if len(inputs) == 1 and inputs[0].format != "datasets":
        return file_sha256(inputs[0].path)
    return hashlib.sha256("".join(input_sha256(i) + "\n" for i in inputs).encode()).hexdigest()


def records(inp: Input) -> Iterator[tuple[str, Any]]:
    """(where, record) for each record of one input (see the module docstring)."""
    try:
        if inp.format == "parquet":
            yield from _parquet(inp.path)
        elif inp.format == "datasets":
            yield from _rows(inp.path, load_dataset_table(inp.path).to_batches(BATCH_ROWS))
        elif inp.format in ("csv", "tsv"):
            yield from ((f"{inp.path}:{n}", r) for n, r in csv_rows(inp.path, inp.compression, inp.format, "strict"))
        else:
            with open_stream(inp.path, inp.compression) as f:
                data = f.read().removeprefix(UTF8_BOM)
            if inp.format == "json":
                yield from _array(inp.path, data)
            else:
                yield from _lines(inp.path, data)
    except UnicodeDecodeError as e:
        raise DataError(f"{inp.path}: not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None
    except DataError:
        raise
    except read_errors() as e:
        raise damaged(inp, e) from None


def _parquet(path: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: Parquet input needs pyarrow: pip install 'shardlab[data]'") from None
    yield from _rows(path, pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS))


def _rows(path: str, batches) -> Iterator[tuple[str, Any]]:
    n = 0
    for batch in batches:
        for row in batch.to_pylist():
            n += 1
            yield f"{path}: row {n}", row


def _array(path: str, data: bytes) -> Iterator[tuple[str, Any]]:
    try:
        values = json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); fix the file at that line") from None
    if not isinstance(values, list):
        raise DataError(f"{path}: a JSON {type(values).__name__}, not an array of records; give JSONL or an array")
    yield from ((f"{path} record {k}", r) for k, r in enumerate(values, 1))


def _lines(path: str, data: bytes) -> Iterator[tuple[str, Any]]:
    for n, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        where = functools.partial("{}:{}".format, path, n)
        try:
            yield where(), json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{where()}: not UTF-8 ({e.reason}); convert the file to UTF-8") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{where()}: not valid JSON ({e.msg}); each line of a JSONL file must be one JSON "
                            "object, e.g. {\"instruction\": ..., \"output\": ...}") from None
