"""The embedded default corpus: English prose that exists on every machine with Python.

It is built at run time from the docstrings of the Python standard library's own modules
(module, class and function docstrings, in sorted file order), so nothing is downloaded
and nothing third-party is shipped. The text differs a little between Python versions but
is fixed for one installation; its SHA-256 goes into run_args.json.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
import tempfile
from pathlib import Path

DEFAULT_MAX_BYTES = 4 * 2**20


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 80:  # one-liners are mostly noise
                out.append(doc.strip())
    return out


def corpus_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """The docstrings, each one document, at most max_bytes of UTF-8 in all (with a blank line
    after each), deterministic for this Python."""
    root = _stdlib_dir()
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "dist-packages"}
    docs, size = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                source = Path(dirpath, name).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            for doc in _docstrings(source):
                size += len(doc.encode()) + 2
                if size > max_bytes:
                    return docs
                docs.append(doc)
    return docs


def build_corpus_text(max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """The docstrings concatenated, each followed by a blank line."""
    return "".join(doc + "\n\n" for doc in corpus_documents(max_bytes))


def cache_dir() -> Path:
    base = os.environ.get("SHARDLAB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "shardlab")
    return Path(base)


def _write_once(path: Path, write) -> Path:
    """Build (once) and cache a file; the write is atomic, so concurrent builders are safe."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".corpus-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        write(f)
    os.replace(tmp, path)
    return path


def _tag(max_bytes: int) -> str:
    import sys

    return f"py{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}-{max_bytes}"


def corpus_path(max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """The corpus as one text file (docstrings separated by blank lines), cached."""
    return _write_once(cache_dir() / f"stdlib-docstrings-{_tag(max_bytes)}.txt",
                       lambda f: f.write(build_corpus_text(max_bytes)))


def corpus_jsonl_path(max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """The corpus as JSONL, one docstring a record ({"text": ...}): what data.source=builtin
    prepares, so that its validation split is held-out docstrings."""
    import json

    return _write_once(cache_dir() / f"stdlib-docstrings-{_tag(max_bytes)}.jsonl",
                       lambda f: f.writelines(json.dumps({"text": d}) + "\n" for d in corpus_documents(max_bytes)))


def corpus_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
