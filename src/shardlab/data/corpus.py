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


def build_corpus_text(max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Concatenated stdlib docstrings, at most max_bytes of UTF-8, deterministic for this Python."""
    root = _stdlib_dir()
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "dist-packages"}
    pieces, size = [], 0
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
                piece = doc + "\n\n"
                size += len(piece.encode())
                if size > max_bytes:
                    return "".join(pieces)
                pieces.append(piece)
    return "".join(pieces)


def cache_dir() -> Path:
    base = os.environ.get("SHARDLAB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "shardlab")
    return Path(base)


def corpus_path(max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Build (once) and cache the corpus; the write is atomic, so concurrent builders are safe."""
    import sys

    tag = f"py{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}-{max_bytes}"
    path = cache_dir() / f"stdlib-docstrings-{tag}.txt"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    text = build_corpus_text(max_bytes)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".corpus-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def corpus_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
