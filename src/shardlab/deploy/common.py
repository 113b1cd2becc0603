"""What every renderer shares: argument checks, the resolved config, and writing files.

The order matters: every check runs before the first file is written, so a bad
request leaves the output directory untouched.
"""

from __future__ import annotations

import argparse
import re
import shlex
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shardlab import config as shardlab_config
from shardlab.errors import RenderError
from shardlab.shipped import config_path as shipped_or_file

RESOLVED_CONFIG_NAME = "shardlab-config.yaml"

# Kubernetes object names (RFC 1123 labels) are the strictest names we emit; Slurm job
# names are free text, but keeping one rule for both keeps rendered files comparable.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class DeployTarget:
    """One `shardlab render/submit` target (the registry: shardlab.deploy.DEPLOY_TARGETS).

    add_arguments: its options, beside the common ones (`add_common_arguments`);
    render: (parsed args, the common request fields) -> (written files, how to submit them);
    submit: (parsed args, output directory) -> exit code, for targets that can be submitted,
    with submit_arguments for the options only submitting takes."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    render: Callable[[argparse.Namespace, dict], tuple[list[Path], str]]
    submit: Callable[[argparse.Namespace, Path], int] | None = None
    submit_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None


def add_common_arguments(p: argparse.ArgumentParser, target: str) -> None:
    p.add_argument("config", metavar="CONFIG.yaml", help="shardlab config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.steps=100")
    p.add_argument("--nodes", type=int, default=1, help="machines (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=1,
                   help="GPUs per machine; 0 = CPU workers with gloo (slurm, k8s) (default 1)")
    p.add_argument("--out", type=Path, default=None, help=f"output directory (default deploy/{target})")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun agent restarts before giving up (default 3)")


def add_min_nodes_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-nodes", type=int, default=None, metavar="MIN",
                   help="elastic: torchrun --nnodes=MIN:NODES; the job goes on at the same global batch when nodes "
                        "are lost, down to MIN, and grows back when they return (docs/elastic.md; default: fixed size)")


def node_range(min_nodes: int | None, nodes: int) -> tuple[int, int]:
    """(MIN, MAX) nodes of the job: (nodes, nodes) unless --min-nodes makes it elastic."""
    lo = nodes if min_nodes is None else min_nodes
    if not 1 <= lo <= nodes:
        raise RenderError(f"--min-nodes {lo}: needs 1 <= --min-nodes <= --nodes ({nodes})")
    return lo, nodes


def check_every_size(run: ResolvedRun, nproc: int, lo: int, hi: int) -> None:
    """An elastic job may run at any size MIN..MAX nodes: the config must have a layout at each."""
    from shardlab.loop.elastic import check_node_range

    try:
        check_node_range(lambda world: shardlab_config.validate_for_world(run.config, world), nproc, lo, hi)
    except shardlab_config.ConfigError as e:
        raise RenderError(f"config: {e}") from e


def out_dir(args: argparse.Namespace) -> Path:
    return args.out if args.out is not None else Path("deploy") / args.target


@dataclass
class ResolvedRun:
    """The user's config after overrides, checked for the world size it will run at."""

    config: object            # shardlab.config.Config
    yaml_text: str            # what dump_config wrote; the rendered files point at this text
    world_size: int
    overrides: list[str] = field(default_factory=list)


def check_dns_label(value: str, what: str, max_len: int = 63) -> str:
    if not _DNS_LABEL.match(value) or len(value) > max_len:
        raise RenderError(
            f"{what} {value!r} is not a valid name: use lower-case letters, digits and '-', "
            f"start and end with a letter or digit, at most {max_len} characters")
    return value


def check_positive(value: int, what: str, minimum: int = 1) -> int:
    if value < minimum:
        raise RenderError(f"{what} must be >= {minimum}, got {value}")
    return value


def has_override(overrides: list[str], key: str) -> bool:
    return any(o.split("=", 1)[0].strip() == key for o in overrides)


def with_defaults(overrides: list[str], defaults: dict[str, str]) -> list[str]:
    """Overrides the launcher needs (e.g. resume=auto so a restarted job continues), placed
    before the user's so an explicit user value still wins."""
    added = [f"{k}={v}" for k, v in defaults.items() if not has_override(overrides, k)]
    return added + list(overrides)


def resolve_config(config_path: str | None, overrides: list[str], world_size: int) -> ResolvedRun:
    """Load, override and validate the config for `world_size` ranks; raise RenderError."""
    if config_path is not None and shipped_or_file(config_path) is None:
        raise RenderError(f"config file {config_path!r} does not exist (nor is it a shipped config's name: "
                          "`shardlab configs`)")
    try:
        cfg = shardlab_config.load_config(config_path, list(overrides))
        shardlab_config.validate_for_world(cfg, world_size)
    except shardlab_config.ConfigError as e:
        raise RenderError(f"config: {e}") from e
    return ResolvedRun(config=cfg, yaml_text=shardlab_config.dump_config(cfg), world_size=world_size,
                       overrides=list(overrides))


def write_files(out_dir: Path, files: dict[str, str], executable: tuple[str, ...] = ()) -> list[Path]:
    """Write every file (relative path -> text); only called once all checks have passed."""
    written = []
    for rel, text in files.items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel in executable:
            path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        written.append(path)
    return written


def sh_quote(value: str) -> str:
    return shlex.quote(str(value))
