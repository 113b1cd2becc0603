"""The examples of `data.source=sft` (data/sft.py): records read from data.path and checked
(`read_examples`, `check_example`: alpaca, chat or prompt/completion, each with a response to
learn), or the embedded default instruction set (`builtin_examples`).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any


class SFTDataError(ValueError):
    """Bad SFT data; the message names the file, the line and the fix."""


# -- reading ---------------------------------------------------------------------------------------
def read_examples(path: str) -> list[dict[str, Any]]:
    """Records of data.path (a file, folder or glob of JSONL, JSON arrays, Parquet, CSV or
    `datasets` folders, compressed or not: data/records.py), each checked: alpaca, chat or
    prompt/completion, with a response. Errors name the file and the line or row."""
    return read_with_hash(path)[0]


def read_with_hash(path: str) -> tuple[list[dict[str, Any]], str]:
    """read_examples' examples and the data's content hash."""
    from shardlab.data import records as R
    from shardlab.data.shards import DataError

    try:
        inputs = R.scan(path)
        out = [check_example(r, where) for inp in inputs for where, r in R.records(inp)]
        digest = R.sha256(inputs)
    except DataError as e:
        raise SFTDataError(str(e)) from None
    if not out:
        raise SFTDataError(f"{path}: no examples; give alpaca records (instruction/input/output) or chat records "
                           "(messages with roles)")
    return out, digest


def check_example(r: Any, where: str) -> dict[str, Any]:
    """Record `r` (at `where`, for the message) as an example: alpaca, or chat (prompt/completion
    becomes chat); SFTDataError naming the fix when it is neither or has no response to learn."""
    if not isinstance(r, dict):
        raise SFTDataError(f"{where}: expected a JSON object, got {type(r).__name__}")
    if "messages" in r:
        msgs = r["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in msgs):
            raise SFTDataError(f"{where}: \"messages\" must be a list of {{\"role\": ..., \"content\": ...}} objects")
        bad = [m["role"] for m in msgs if m["role"] not in ("system", "user", "assistant")]
        if bad:
            raise SFTDataError(f"{where}: unknown role {bad[0]!r}; use system, user or assistant")
        if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
            raise SFTDataError(f"{where}: no response: the messages hold no non-empty assistant turn; add one "
                               "or remove the example")
        if msgs[-1]["role"] != "assistant":
            raise SFTDataError(f"{where}: the conversation ends with a {msgs[-1]['role']} turn, after the last "
                               "response: nothing would teach the model to answer it. End each record with an "
                               "assistant turn (remove the trailing turn or add its answer)")
        return {"messages": msgs}
    if "prompt" in r and "completion" in r:  # TRL's prompt-completion: two texts, or two lists of messages
        p, c = r["prompt"], r["completion"]
        if isinstance(p, str) and isinstance(c, str):
            return check_example({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]},
                                 where)
        if isinstance(p, list) and isinstance(c, list):
            return check_example({"messages": p + c}, where)
        raise SFTDataError(f"{where}: \"prompt\" and \"completion\" must both be text or both lists of messages")
    if "instruction" in r or "output" in r:
        if not isinstance(r.get("instruction"), str) or not r["instruction"].strip():
            raise SFTDataError(f"{where}: alpaca record without an \"instruction\" string")
        out = r.get("output")
        if not isinstance(out, str) or not out.strip():
            raise SFTDataError(f"{where}: no response: \"output\" is missing or empty; add the response or remove "
                               "the example")
        inp = r.get("input") or ""
        if not isinstance(inp, str):
            raise SFTDataError(f"{where}: \"input\" must be a string")
        return {"instruction": r["instruction"], "input": inp, "output": out}
    raise SFTDataError(f"{where}: neither alpaca (instruction/input/output), chat (messages) nor "
                       f"prompt/completion keys; found {sorted(r)[:5]}")


# -- the embedded default instruction set ------------------------------------------------------------
BUILTIN_MODULES = ("os", "os.path", "shutil", "json", "re", "math", "string", "textwrap", "itertools",
                   "functools", "collections", "heapq", "bisect", "random", "statistics", "datetime",
                   "pathlib", "glob", "fnmatch", "base64", "hashlib", "zlib", "gzip", "csv", "difflib",
                   "inspect", "operator", "copy", "pprint", "tempfile", "uuid", "urllib.parse", "html",
                   "time", "calendar", "decimal", "fractions", "struct", "secrets", "shlex")


def builtin_examples(limit: int = 2000) -> list[dict[str, Any]]:
    """Questions about standard-library functions, answered by the first paragraph of their
    docstrings: built at run time from this Python installation, nothing shipped."""
    out = []
    for mod_name in BUILTIN_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name in sorted(dir(mod)):
            if name.startswith("_"):
                continue
            obj = getattr(mod, name, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            para = doc.split("\n\n")[0].strip()
            if len(para) < 40 or para.startswith(name + "("):
                continue
            kind = "class" if inspect.isclass(obj) else "function"
            out.append({"instruction": f"What does the Python {kind} {mod_name}.{name} do?", "input": "",
                        "output": " ".join(para.split())})
            if len(out) >= limit:
                return out
    return out
