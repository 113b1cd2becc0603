"""`model.hf_path`'s safetensors files, checked from their headers before any worker starts.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (name ->
dtype, shape, data_offsets [begin, end) into the data that follows; plus an optional
`__metadata__`), then the tensors' bytes. A truncated copy or a zeroed header is otherwise
found only inside every worker, by the first `safe_open`, as a traceback per rank that names
no file. Here the launching process reads each file's header (never the tensor data: a few
kilobytes per file, whatever the model's size) and checks what safetensors itself would
refuse: the header parses, each tensor's byte range is as long as its dtype and shape say and
lies inside the file, and the file ends where the last tensor ends. The errors are one line
naming the file.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, NoReturn

from shardlab.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"   # the names transformers' save_pretrained writes
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20                # safetensors refuses larger headers

#: bits per element of every dtype safetensors writes
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
              "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}

_RESAVE = "re-save the model with save_pretrained(..., safe_serialization=True), or copy the file again"


def check_safetensors_dir(hf_path: str) -> None:
    """Every safetensors file of `hf_path` (the index's shards, else model.safetensors) is whole;
    raises ConfigError naming the file and what is wrong. A directory with neither is left to
    the caller's own message."""
    index = os.path.join(hf_path, INDEX_FILE)
    if os.path.isfile(index):
        for path, keys in _index_shards(index).items():
            names = check_safetensors_file(path)
            missing = sorted(set(keys) - names)
            if missing:
                raise ConfigError(f"{path}: {INDEX_FILE} places {len(missing)} tensor(s) in this file that it does "
                                  f"not hold (e.g. {missing[0]!r}); {_RESAVE}")
    elif os.path.isfile(os.path.join(hf_path, SINGLE_FILE)):
        check_safetensors_file(os.path.join(hf_path, SINGLE_FILE))


def _index_shards(index: str) -> dict[str, list[str]]:
    """shard file -> the tensors the index places in it; every shard must exist."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); {_RESAVE}") from None
    shards: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        shards.setdefault(os.path.join(os.path.dirname(index), str(name)), []).append(key)
    for path in shards:
        if not os.path.isfile(path):
            raise ConfigError(f"{index} names {os.path.basename(path)}, which is not in {os.path.dirname(index)}; "
                              f"copy the missing shard, or {_RESAVE}")
    return shards


def check_safetensors_file(path: str) -> set[str]:
    """The tensor names of the safetensors file `path`, once its header is checked against its
    size; raises ConfigError with the file's name and the fault."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            _fail(path, f"{size} bytes, shorter than the 8-byte header length (truncated)")
        n = int.from_bytes(head, "little")
        if n == 0:
            _fail(path, "the header length is 0 (the file's start is zeroed or overwritten)")
        if n > min(size - 8, MAX_HEADER_BYTES):
            _fail(path, f"the header claims {n} bytes but the file has {size - 8} after the length "
                        "(truncated, or not a safetensors file)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        _fail(path, f"its {n}-byte header is not valid JSON ({e}): corrupted")
    if not isinstance(header, dict):
        _fail(path, f"its header is a JSON {type(header).__name__}, not an object: corrupted")
    end = _check_tensors(path, {k: v for k, v in header.items() if k != "__metadata__"}, size - 8 - n)
    if size != 8 + n + end:
        _fail(path, f"{size} bytes where the header says {8 + n + end} (8 + {n} header + {end} data): "
                    f"{size - 8 - n - end} bytes after the last tensor")
    return set(header) - {"__metadata__"}


def _check_tensors(path: str, tensors: dict[str, Any], data_bytes: int) -> int:
    """Each entry's dtype, shape and byte range agree and lie within the `data_bytes` after the
    header; returns the largest end offset."""
    end = 0
    for name, info in tensors.items():
        try:
            dtype, shape, (begin, stop) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            _fail(path, f"tensor {name!r} has no dtype, shape and data_offsets [begin, end] in the header")
        if dtype not in DTYPE_BITS:
            _fail(path, f"tensor {name!r} has unknown dtype {dtype!r}")
        if not all(isinstance(d, int) and d >= 0 for d in shape) \
                or not all(isinstance(o, int) for o in (begin, stop)) or not 0 <= begin <= stop:
            _fail(path, f"tensor {name!r}: shape {shape} or data_offsets [{begin}, {stop}] is not valid")
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if stop - begin != (bits + 7) // 8:
            _fail(path, f"tensor {name!r} ({dtype} {shape}) needs {(bits + 7) // 8} bytes, its data_offsets "
                        f"[{begin}, {stop}] hold {stop - begin}")
        if stop > data_bytes:
            _fail(path, f"tensor {name!r} ends at data byte {stop}, past the file's {data_bytes} data bytes "
                        "(truncated)")
        end = max(end, stop)
    return end


def _fail(path: str, what: str) -> NoReturn:
    raise ConfigError(f"model.hf_path: {path}: {what}; {_RESAVE}")
