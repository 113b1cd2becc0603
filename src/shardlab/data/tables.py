"""Tables `shardlab prepare` and SFT read (data/inputs.py, data/records.py): CSV/TSV files and
`datasets` save_to_disk folders.

[Note: CSV and TSV] A `.csv` or `.tsv` (compressed or not, data/formats.py) is read by the
standard library's csv module, as pandas and `datasets` read such files by default: the first
row is the header, the document of each later row is its --field column (a quoted field may
hold commas, quotes and newlines). A file whose header has no such column is refused in one
line naming its columns: a table is never read as one document, and the first row is never
guessed to be data. Each row is one record: a row shorter than the header, or a null (empty)
text, is skipped as JSONL's are (a short row is a bad record, named by its line). A CSV is read
whole by one worker (a quoted newline means it cannot be cut at a line boundary by bytes).

[Note: datasets folders] `datasets`' save_to_disk writes a Dataset as Arrow IPC stream files
(`data-00000-of-0000N.arrow`, listed in state.json's `_data_files`) beside state.json and
dataset_info.json; a DatasetDict adds dataset_dict.json (`{"splits": [...]}`) and a Dataset
folder per split. They are read here with pyarrow alone (memory-mapped, as `datasets` does),
without the `datasets` package; a DatasetDict gives each of its splits (or the ones --split
names) as an input of its own, `DIR/SPLIT`.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
from collections.abc import Iterator
from typing import Any

from shardlab.data.formats import UTF8_BOM, open_stream
from shardlab.data.shards import DataError

csv.field_size_limit(2**31 - 1)  # a document may be longer than the module's 128 KiB default


# -- CSV / TSV ------------------------------------------------------------------------------------
def _reader(f, fmt: str, errors: str = "strict"):
    text = io.TextIOWrapper(f, encoding="utf-8", errors=errors, newline="")
    return csv.reader(text, delimiter="\t" if fmt == "tsv" else ",")


def csv_header(path: str, compression: str | None, fmt: str) -> list[str]:
    """The header row (a leading BOM dropped)."""
    with open_stream(path, compression) as f:
        header = next(_reader(f, fmt, "replace"), [])
    if header:
        header[0] = header[0].removeprefix("\ufeff")
    return header


def csv_column(path: str, compression: str | None, fmt: str, field: str) -> int:
    """The index of column `field`, or the one-line refusal (see [Note: CSV and TSV])."""
    header = csv_header(path, compression, fmt)
    if field not in header:
        raise DataError(f"{path}: a {fmt.upper()} whose header row has no column {field!r} (it has "
                        f"{header[:8]}); pass --field NAME of the text column (the first row must be the header)")
    return header.index(field)


def csv_rows(path: str, compression: str | None, fmt: str, errors: str) -> Iterator[tuple[int, dict[str, str]]]:
    """(line, record) for each row after the header; a row shorter than it lacks the missing
    columns. A BOM before the header is dropped (csv_bom says whether there was one)."""
    with open_stream(path, compression) as f:
        rows = _reader(f, fmt, errors)
        header = next(rows, [])
        if header:
            header[0] = header[0].removeprefix("\ufeff")
        line = rows.line_num + 1
        for row in rows:
            if row:
                yield line, {k: row[i] for i, k in enumerate(header[:len(row)])}
            line = rows.line_num + 1


def csv_bom(path: str, compression: str | None) -> bool:
    with open_stream(path, compression) as f:
        return f.read(3) == UTF8_BOM


# -- datasets folders -----------------------------------------------------------------------------
def dataset_splits(path: str, choose: list[str] | None) -> list[str]:
    """The Dataset folders of a `datasets` folder: itself, or its DatasetDict's splits (all, or
    those `choose` names, in its order)."""
    dd = os.path.join(path, "dataset_dict.json")
    if not os.path.isfile(dd):
        return [path]
    try:
        with open(dd) as f:
            splits = list(json.load(f)["splits"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{dd}: not a DatasetDict's dataset_dict.json ({e})") from None
    if choose:
        missing = [s for s in choose if s not in splits]
        if missing:
            raise DataError(f"{path}: a DatasetDict without split {missing[0]!r} (its splits: {splits}); "
                            "pass --split with some of those")
        splits = [s for s in splits if s in choose]
    return [os.path.join(path, s) for s in splits]


def arrow_files(path: str) -> list[str]:
    try:
        with open(os.path.join(path, "state.json")) as f:
            names = [d["filename"] for d in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        names = []
    return [os.path.join(path, n) for n in names] or sorted(glob.glob(os.path.join(glob.escape(path), "*.arrow")))


def load_dataset_table(path: str, columns: list[str] | None = None) -> Any:
    """A Dataset folder's rows as one pyarrow Table, memory-mapped (no copy)."""
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError(f"{path}: a `datasets` folder needs pyarrow: pip install 'shardlab[data]'") from None
    files = arrow_files(path)
    if not files:
        raise DataError(f"{path}: a `datasets` folder without Arrow files (state.json lists none, no *.arrow)")
    tables = []
    for name in files:
        try:
            tables.append(pa.ipc.open_stream(pa.memory_map(name)).read_all())
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"{name}: cannot read it as an Arrow stream ({e}); the file is damaged or truncated, "
                            "or not written by datasets' save_to_disk") from None
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    if columns:
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r} (columns: {table.column_names[:8]}); "
                            "pass --field NAME")
        table = table.select(columns)
    return table
