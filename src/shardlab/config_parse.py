"""A config's text to typed sections: YAML reading, dotted `key=value` overrides, and the
dataclasses built from the nested mapping with every key and type checked (unknown keys with a
"did you mean", wrong types, a YAML syntax error with file and line). Standard library and YAML
only: the CLI runs it before it imports torch (config_checks.py), config.py after.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from typing import Any

import yaml

from shardlab.errors import ConfigError
from shardlab.shipped import config_path, shipped_configs

# YAML keys that are not valid Python names map to fields here.
ALIASES = {("checkpoint", "async"): "async_save"}
ALIASES_BACK = {(sec, fld): key for (sec, key), fld in ALIASES.items()}
# Keys that were true/false and became a choice: the old spellings still load, with a
# deprecation note. (section, key) -> {old: new}
BOOL_SPELLINGS = {("train", "activation_checkpointing"): {True: "full", False: "none"}}


def to_dict(obj: Any, section: str = "") -> Any:
    """A config (or one section) as plain nested dicts, under its YAML keys."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            key = ALIASES_BACK.get((section, f.name), f.name)
            out[key] = to_dict(getattr(obj, f.name), f.name)
        return out
    if isinstance(obj, list):
        return list(obj)
    if isinstance(obj, dict):
        return dict(obj)
    return obj


# ---------------------------------------------------------------------------------------- reading
def read_raw(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The YAML file (a path or a shipped config's name; None: nothing) as a nested mapping, with
    the `a.b=value` overrides applied; nothing checked beyond its syntax."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(path)
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value)
    return raw


def _read_yaml(path: str) -> dict[str, Any]:
    found = config_path(path)
    if found is None:
        raise ConfigError(f"config file {path!r} not found; give a path to a YAML file or the name of a "
                          f"shipped config ({', '.join(shipped_configs())}; `shardlab configs` lists them)")
    with open(found) as f:
        text = f.read()
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{found}:{mark.line + 1}:{mark.column + 1}" if mark else found
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: YAML syntax error: {problem}; fix the YAML at that line") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{found}: the top level must be a mapping of sections (model:, train:, ...), "
                          f"not a {type(loaded).__name__}")
    return loaded


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value, e.g. train.steps=100")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has no key before '='")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text  # an unparseable value is taken as a plain string; type checks follow
    return key, value


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}=...: {part!r} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


# --------------------------------------------------------------------------------------- building
def known_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key a config of this class takes, in its order."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = ALIASES_BACK.get((prefix.rstrip("."), f.name), f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys += known_keys(hints[f.name], prefix + name + ".")
        else:
            keys.append(prefix + name)
    return keys


def _unknown_key_error(full_key: str, root: type) -> ConfigError:
    known = known_keys(root)
    close = difflib.get_close_matches(full_key, known, n=1, cutoff=0.6)
    if not close:  # try the last component alone: "train.step" vs "train.steps", "lr" vs "train.lr"
        last = full_key.split(".")[-1]
        close = [k for k in known if difflib.get_close_matches(last, [k.split(".")[-1]], cutoff=0.75)][:1]
    hint = f"; did you mean {close[0]!r}?" if close else "; run `shardlab train --print-config` to see every key"
    return ConfigError(f"unknown config key {full_key!r}{hint}")


def build(root: type, raw: Any) -> Any:
    """The dataclass `root` built from a nested mapping, every key known and every value of its type."""
    return _build(root, raw, "", root)


def _build(cls: type, raw: Any, prefix: str, root: type) -> Any:
    section = prefix.rstrip(".")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{section or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    by_key = {ALIASES_BACK.get((section, f.name), f.name): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in by_key:
            while isinstance(value, dict) and len(value) == 1:  # misspelt section: name the whole key
                (sub, value), = value.items()
                full = f"{full}.{sub}"
            raise _unknown_key_error(full, root)
        f = by_key[key]
        tp = hints[f.name]
        value = _renew_bool_spelling(section, key, value)
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, value, full + ".", root)
        else:
            kwargs[f.name] = _coerce(value, tp, full)
    return cls(**kwargs)


def _renew_bool_spelling(section: str, key: str, value: Any) -> Any:
    spellings = BOOL_SPELLINGS.get((section, key))
    if spellings is None or not isinstance(value, bool):
        return value
    new = spellings[value]
    # warn_explicit: the note is about the user's config, not a line of shardlab's source
    warnings.warn_explicit(f"{section}.{key}={str(value).lower()} is deprecated and means {new}: write "
                           f"{section}.{key}={new}", FutureWarning, filename="shardlab config", lineno=0)
    return new


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {' to '.join(_type_name(a) for a in typing.get_args(tp))}"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    bad = ConfigError(f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if origin is list:
        if not isinstance(value, list):
            raise bad
        return [_coerce(v, typing.get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        key_type, value_type = typing.get_args(tp)
        return {_coerce(k, key_type, f"{key} key"): _coerce(v, value_type, f"{key}[{k}]") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise bad
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    return value


