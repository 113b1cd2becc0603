"""Render and submit shardlab runs for a cluster: the registry of deploy targets.

Each target lives in its own module and brings a `DeployTarget` (deploy/common.py): its
options, how to render them, and (if it can) how to submit what it rendered. The CLI calls
`add_render_parser(subparsers)` and `add_submit_parser(subparsers)`; each adds one subcommand
per target whose `func(args)` returns the exit code: 0 done, 2 bad request (nothing written),
1 the submit command failed. Adding a target: its module, and one entry in DEPLOY_TARGETS.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

from shardlab.deploy.common import DeployTarget, RenderError, add_common_arguments, out_dir

__all__ = ["DEPLOY_TARGETS", "DeployTarget", "deploy_target", "add_render_parser", "add_submit_parser",
           "RenderError"]

# name -> "module:attribute" of its DeployTarget, imported on first use (so that
# `python -m shardlab.deploy.k8s` does not import its own module twice). The order is the
# order help texts list them in.
DEPLOY_TARGETS: dict[str, str] = {
    "slurm": "shardlab.deploy.slurm:TARGET",
    "k8s": "shardlab.deploy.k8s:TARGET",
    "accelerate": "shardlab.deploy.accelerate:TARGET",
}


def deploy_target(name: str) -> DeployTarget:
    if name not in DEPLOY_TARGETS:
        raise RenderError(f"unknown deploy target {name!r}; valid: {', '.join(DEPLOY_TARGETS)}")
    module, attr = DEPLOY_TARGETS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def _render(args: argparse.Namespace):
    """Build the request for args.target and render it; returns (files, submit hint)."""
    target = deploy_target(args.target)
    common = dict(config=args.config, overrides=list(args.overrides), nodes=args.nodes,
                  gpus_per_node=args.gpus_per_node, out=out_dir(args))
    return target.render(args, common)


def cmd_render(args: argparse.Namespace) -> int:
    try:
        written, hint = _render(args)
    except RenderError as e:
        print(f"shardlab render {args.target}: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    print(f"submit with: {hint}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        target = deploy_target(args.target)
        if target.submit is None:
            raise RenderError(f"{args.target} files cannot be submitted by shardlab; render them and run them")
        _render(args)
        return target.submit(args, out_dir(args))
    except RenderError as e:
        print(f"shardlab submit {args.target}: {e}", file=sys.stderr)
        return 2 if not isinstance(e.__cause__, subprocess.SubprocessError) else 1
    except subprocess.TimeoutExpired as e:
        print(f"shardlab submit {args.target}: {e}", file=sys.stderr)
        return 1


def add_render_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("render", help=f"write {' / '.join(DEPLOY_TARGETS)} files for a config",
                              description="Write ready-to-submit files for a config and print how to submit them.")
    targets = p.add_subparsers(dest="target", metavar="{" + ",".join(DEPLOY_TARGETS) + "}", required=True)
    for name in DEPLOY_TARGETS:
        target = deploy_target(name)
        t = targets.add_parser(name, help=f"render for {name}: {target.help}")
        add_common_arguments(t, name)
        target.add_arguments(t)
    p.set_defaults(func=cmd_render)
    return p


def add_submit_parser(subparsers) -> argparse.ArgumentParser:
    submittable = {name: t for name in DEPLOY_TARGETS if (t := deploy_target(name)).submit is not None}
    p = subparsers.add_parser("submit", help="render, then submit (" + ", ".join(submittable) + ")",
                              description="Render the files, then submit them.")
    targets = p.add_subparsers(dest="target", metavar="{" + ",".join(submittable) + "}", required=True)
    for name, target in submittable.items():
        t = targets.add_parser(name, help=f"render and submit to {name}")
        add_common_arguments(t, name)
        target.add_arguments(t)
        target.submit_arguments(t)
    p.set_defaults(func=cmd_submit)
    return p
