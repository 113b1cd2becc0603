"""The example configs that ship inside the package (src/shardlab/configs/, package data), so a
`pip install` of the wheel has them: `shardlab train NAME`, `shardlab configs`.

[Note: one copy of the configs]
The YAML files and the HF config JSONs they name live in the package, src/shardlab/configs/;
the repository's `configs/` is a symbolic link to that directory, so the commands in the README
(`shardlab train configs/gpt-tiny.yaml`) keep working in a clone and nothing can drift between
two copies. Links never enter the wheel: setuptools packs the real files from src/ (package-data
in pyproject.toml), and tests/test_shipped_configs.py installs the built wheel into a fresh
environment outside the repository and trains a shipped config there.
A config refers to a shipped HF config JSON by name (`model.hf_config: mistral-tiny`), never by
a path relative to the repository, so it resolves in any installation, a rendered cluster job's
included.
"""

from __future__ import annotations

import re
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"


def shipped_configs() -> dict[str, Path]:
    """name -> YAML file of every shipped example config."""
    return {p.stem: p for p in sorted(CONFIG_DIR.glob("*.yaml"))}


def shipped_hf_configs() -> dict[str, Path]:
    """name -> transformers config JSON that a config can name in model.hf_config."""
    return {p.stem: p for p in sorted((CONFIG_DIR / "hf").glob("*.json"))}


def config_path(arg: str) -> str | None:
    """`shardlab train ARG`: ARG itself when it is a file, else the shipped config of that name
    (with or without .yaml); None when neither."""
    if Path(arg).is_file():
        return arg
    found = shipped_configs().get(arg.removesuffix(".yaml").removesuffix(".yml"))
    return str(found) if found is not None and "/" not in arg else None


def hf_config_path(arg: str) -> str | None:
    """model.hf_config: a path as given, else a shipped HF config's name; None when neither."""
    if Path(arg).exists():
        return arg
    found = shipped_hf_configs().get(arg.removesuffix(".json"))
    return str(found) if found is not None and "/" not in arg else None


# The line of a config's leading comment that says how many parameters its model has as built
# (tests/test_cli_fast.py builds each shipped config's model on the meta device to check it).
PARAMETERS_LINE = re.compile(r"^# Parameters: ([0-9,]+) as built", re.MULTILINE)


def stated_parameters(path: Path) -> int | None:
    """The parameter count a config's comment states (`# Parameters: N as built`); None if none."""
    found = PARAMETERS_LINE.search(path.read_text(encoding="utf-8"))
    return int(found.group(1).replace(",", "")) if found else None


def short_count(n: int) -> str:
    """842496 -> 0.84M, 86039040 -> 86.0M, 8030261248 -> 8.03B: three significant digits."""
    value, unit = (n / 1e9, "B") if n >= 1e9 else (n / 1e6, "M")
    decimals = 0 if value >= 100 else 1 if value >= 10 else 2
    return f"{value:.{decimals}f}{unit}"


def describe(path: Path, width: int = 100) -> str:
    """The first sentence of a config file's leading comment: what it is."""
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        words += line.lstrip("#").split()
        if words and words[-1].endswith("."):
            break
    text = " ".join(words)
    text = text.split(". ")[0].rstrip(".")
    return text if len(text) <= width else text[:width - 3].rstrip() + "..."
