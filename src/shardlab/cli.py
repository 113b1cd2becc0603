"""The `shardlab` command.

  shardlab train [CONFIG.yaml] [key=value ...] [--nproc N] [--max-restarts R] [--print-config]
  shardlab bench [CONFIG.yaml] [key=value ...] [--nproc 1,2,4]  measure every engine side by side
  shardlab plan CONFIG.yaml [key=value ...] --gpu T4 --nproc N [--nodes K]  predict peak memory and step time
  shardlab verify CONFIG.yaml [key=value ...] --nproc N    prove the engine trains exactly as one process
  shardlab render {slurm,k8s,accelerate} CONFIG.yaml ...    write a job for a cluster
  shardlab submit {slurm,k8s} CONFIG.yaml ...               render and submit it
  shardlab export RUN_DIR | generate RUN_DIR | eval RUN_DIR  use a trained checkpoint
Each command's --help lists its options.
"""

from __future__ import annotations

import argparse
import sys

TRAIN_EPILOG = """\
examples:
  shardlab train configs/gpt-tiny.yaml --nproc 2
  shardlab train configs/gpt-tiny.yaml --nproc 4 parallel.strategy=zero3 train.steps=50
  shardlab train configs/resnet-cifar10.yaml data.path=~/data --nproc 2
  shardlab train configs/gpt-tiny.yaml --print-config

strategies (parallel.strategy): single, ddp, zero3, fsdp (shardlab's own, from scratch),
  torch-ddp (DistributedDataParallel), torch-fsdp (FSDP2 fully_shard).
Without --nproc, shardlab runs as one worker of a job started elsewhere (torchrun, srun,
a Kubernetes pod), taking RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT or the
SLURM_* variables from the environment; with none of them, as a single process.
Outputs: <output.dir>/<output.run_name>/{run_args.json,metrics.json,config.yaml,tensorboard/}.
"""


def _train(args: argparse.Namespace) -> int:
    from shardlab.config import ConfigError, dump_config, load_config, validate_for_world
    from shardlab.runtime import env_world, in_launched_worker

    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(dump_config(cfg), end="")
            return 0
        if args.nproc is not None:
            if args.nproc < 1:
                raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
            if in_launched_worker():
                raise ConfigError("--nproc starts local workers, but this process already is a worker "
                                  "(RANK/WORLD_SIZE are set); drop --nproc under torchrun/srun")
            validate_for_world(cfg, args.nproc)
        else:
            validate_for_world(cfg, env_world()[2])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.nproc is not None:
        from shardlab.launcher import launch_local
        from shardlab.train import default_run_name

        if not cfg.output.run_name:
            cfg.output.run_name = default_run_name(cfg)
        try:
            _prepare_data(cfg)
        except ValueError as e:  # bad data: said before any worker starts
            print(f"error: {e}", file=sys.stderr)
            return 2
        return launch_local(cfg, args.nproc, args.max_restarts)
    from shardlab.train import worker_main

    return worker_main(cfg)


def _prepare_data(cfg) -> None:
    """Work every worker would repeat (building the embedded corpus) is done once, before they start."""
    if cfg.data.source == "builtin":
        from shardlab.data.corpus import corpus_path

        corpus_path()
    if cfg.data.source == "sft":  # read, check (errors name file and line), tokenize and cache once
        from shardlab.data.sft import prepare

        prepare(cfg)


def build_parser() -> argparse.ArgumentParser:
    import shardlab

    parser = argparse.ArgumentParser(
        prog="shardlab",
        description="Sharded data-parallel training on PyTorch: DDP, ZeRO-3 and FSDP written from scratch, "
                    "beside PyTorch's DDP and FSDP2, behind one config.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `shardlab COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"shardlab {shardlab.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    tr = sub.add_parser("train", help="train a model on N local workers, or as one worker of a launched job",
                        description="Train a model. Config: YAML file plus dotted key=value overrides.",
                        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    tr.add_argument("config", nargs="?", help="YAML config file (default: built-in defaults)")
    tr.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.steps=100")
    tr.add_argument("--nproc", type=int, default=None, metavar="N",
                    help="start N local worker processes through torchrun's elastic agent")
    tr.add_argument("--max-restarts", type=int, default=0, metavar="R",
                    help="with --nproc: restart the worker group up to R times when a worker fails")
    tr.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    tr.set_defaults(func=_train)

    from shardlab import bench

    be = sub.add_parser("bench", help="measure every engine at every world size, beside the theory",
                        description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(be)
    be.set_defaults(func=bench.run)

    from shardlab import plan

    pl = sub.add_parser("plan", help="predict peak memory per rank of every engine on a GPU, and step time",
                        description=plan.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_arguments(pl)
    pl.set_defaults(func=plan.run)

    from shardlab import verify

    ve = sub.add_parser("verify", help="prove the config trains on N ranks exactly as one process would",
                        description="Prove the config trains on N ranks exactly as one process would: step "
                                    "by step, every gradient and parameter by name, in float64.",
                        epilog=verify.command.EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_arguments(ve)
    ve.set_defaults(func=verify.run)

    # Commands that live beside their feature: render/submit (shardlab.deploy),
    # export/generate/eval (shardlab.export). Each module adds its own subparsers.
    from shardlab.deploy import add_render_parser, add_submit_parser
    from shardlab.export import add_export_parsers

    add_render_parser(sub)
    add_submit_parser(sub)
    add_export_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "train":
        # key=value overrides may come after options; argparse leaves them in `extra`
        bad = [e for e in extra if "=" not in e or e.startswith("-")]
        if bad:
            parser.error(f"unrecognized arguments: {' '.join(bad)}")
        if args.config is not None and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
            args.overrides.insert(0, args.config)
            args.config = None
        args.overrides += extra
    elif extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra  # render/submit: key=value after the options, as for train
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from shardlab.checkpoint import CheckpointError

    try:
        return int(args.func(args) or 0)
    except CheckpointError as e:  # a checkpoint that cannot be used: its message says what to do
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
