"""The `shardlab` command.

  shardlab prepare INPUT... --out DATA_DIR [--tokenizer DIR] [--workers N]  documents to token shards
  shardlab data inspect DATA_DIR [--docs N]  what a prepared corpus holds, its first documents decoded
  shardlab train [CONFIG.yaml|NAME] [key=value ...] [--nproc N] [--fresh] [--max-restarts R] [--verbose] [--print-config]
                [--nnodes MIN:MAX --rdzv-endpoint HOST:PORT --rdzv-id ID]   one agent of an elastic job
  shardlab configs [NAME]                                    the shipped example configs (NAME: print one)
  shardlab bench [CONFIG.yaml] [key=value ...] [--nproc 1,2,4]  measure every engine side by side
  shardlab plan CONFIG.yaml [key=value ...] --gpu T4 --nproc N [--nodes K]  predict peak memory and step time
  shardlab verify CONFIG.yaml [key=value ...] --nproc N    prove the engine trains exactly as one process
  shardlab render {slurm,k8s,accelerate} CONFIG.yaml ...    write a job for a cluster
  shardlab submit {slurm,k8s} CONFIG.yaml ...               render and submit it
  shardlab export RUN_DIR | generate RUN_DIR | eval RUN_DIR  use a trained checkpoint
  shardlab doctor RUN_DIR [--live]                          which rank is stuck, and where every rank waits
  shardlab report RUN_DIR [--out FILE.html] | trace RUN_DIR [--out FILE.json]  where the time and memory went
Each command's --help lists its options.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

ELASTIC_RESTARTS = 3  # --nnodes without --max-restarts: a node lost is a restart of the others

TRAIN_EPILOG = """\
examples:
  shardlab train configs/gpt-tiny.yaml --nproc 2
  shardlab train sft-mistral-tiny --nproc 2        (a shipped config by name: `shardlab configs`)
  shardlab train configs/gpt-tiny.yaml --nproc 4 parallel.strategy=zero3 train.steps=50
  shardlab train configs/resnet-cifar10.yaml data.path=~/data --nproc 2
  shardlab train configs/gpt-tiny.yaml --print-config
  shardlab prepare corpus/ --out data/corpus && shardlab train configs/gpt-tiny.yaml data.source=tokens \\
      data.path=data/corpus --nproc 2

strategies (parallel.strategy): {strategies} (docs/engines.md).
Without --nproc, shardlab runs as one worker of a job started elsewhere (torchrun, srun,
a Kubernetes pod), taking RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT or the
SLURM_* variables from the environment; with none of them, as a single process.
Outputs: <output.dir>/<output.run_name>/{{run_args.json,metrics.json,config.yaml,tensorboard/,debug/}}.
The default run name is <model>-<strategy>-<hash of the config>: the same command continues the
same run from its latest checkpoint (and so does `shardlab train <run dir>/config.yaml`); a finished
run says so and starts nothing (a higher train.steps trains on); --fresh starts over beside it.
A hung or failed run: `shardlab doctor <run dir>` (with --live while it runs) names the stuck rank.
"""


def _train(args: argparse.Namespace) -> int:
    from shardlab.config_checks import precheck
    from shardlab.errors import ConfigError

    try:
        # first what needs no torch: a typo answers at once ([Note: a package that imports torch only when asked])
        precheck(args.config, args.overrides)
        from shardlab.config import dump_config, load_config

        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(dump_config(cfg), end="")
            return 0
        _check_workers(cfg, args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from shardlab.loop.run_contract import settle
    from shardlab.loop.runtime import in_launched_worker
    from shardlab.loop.train import worker_main

    worker = args.nproc is None and in_launched_worker()
    settled = settle(cfg, args.fresh, worker, elastic=args.nnodes is not None)  # [Note: the run contract]
    if settled is not None:
        return settled  # a finished run said so in one line, or --fresh where it cannot be met
    if worker:
        return worker_main(cfg)  # one of N: the workers prepare the data together (local rank 0 first)
    from shardlab.data import prepare_datasets

    try:
        prepare_datasets(cfg)  # once, before the workers start
    except ValueError as e:  # bad data: said before any worker starts
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.nproc is not None:
        from shardlab.loop.launcher import launch_local

        if args.nnodes is not None:
            from shardlab.loop.launcher import launch_elastic

            restarts = ELASTIC_RESTARTS if args.max_restarts is None else args.max_restarts
            return launch_elastic(cfg, args.nproc, args.node_range, args.rdzv_endpoint, args.rdzv_id,
                                  restarts, verbose=args.verbose)
        return launch_local(cfg, args.nproc, args.max_restarts or 0, verbose=args.verbose)
    return worker_main(cfg)


def _check_workers(cfg, args: argparse.Namespace) -> None:
    """The config at the world size --nproc (and --nnodes) asks for, or at that of the job this
    process is a worker of; raises ConfigError."""
    from shardlab.config import ConfigError, validate_for_world
    from shardlab.loop.runtime import env_world, in_launched_worker

    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
        if in_launched_worker():
            raise ConfigError("--nproc starts local workers, but this process already is a worker "
                              "(RANK/WORLD_SIZE are set); drop --nproc under torchrun/srun")
        if args.nnodes is None:
            validate_for_world(cfg, args.nproc)
        else:  # elastic: every world size MIN..MAX may happen (loop/elastic.py)
            from shardlab.loop.elastic import check_node_range, parse_nnodes, require_rdzv_id

            args.node_range = parse_nnodes(args.nnodes)
            check_node_range(lambda world: validate_for_world(cfg, world), args.nproc, *args.node_range)
            require_rdzv_id(args.rdzv_id, args.node_range)
    elif args.nnodes is not None:
        raise ConfigError("--nnodes MIN:MAX starts one elastic agent of --nproc N workers; add --nproc N")
    else:
        validate_for_world(cfg, env_world()[2])


def _configs(args: argparse.Namespace) -> int:
    """`shardlab configs`: the shipped example configs; with a NAME, that config's YAML."""
    from shardlab.shipped import config_path, describe, shipped_configs, short_count, stated_parameters

    if args.name:
        path = config_path(args.name)
        if path is None:
            print(f"error: no shipped config {args.name!r}; shipped: {', '.join(shipped_configs())}", file=sys.stderr)
            return 2
        with open(path) as f:
            print(f.read(), end="")
        return 0
    configs = shipped_configs()
    width = max(map(len, configs))
    for name, path in configs.items():
        count = stated_parameters(path)
        print(f"{name:<{width}}  {short_count(count) if count else '':>6}  {describe(path)}")
    print(f"\nshardlab train NAME [key=value ...]; `shardlab configs NAME > my.yaml` copies one ({path.parent})")
    return 0


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    from shardlab.config_checks import strategy_names

    tr = sub.add_parser("train", help=COMMANDS["train"].help,
                        description="Train a model. Config: YAML file plus dotted key=value overrides.",
                        epilog=TRAIN_EPILOG.format(strategies=", ".join(strategy_names())),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    tr.add_argument("config", nargs="?", help="YAML config file, or a shipped config's name (`shardlab configs`); "
                                              "default: built-in defaults")
    tr.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.steps=100")
    tr.add_argument("--nproc", type=int, default=None, metavar="N",
                    help="start N local worker processes through torchrun's elastic agent")
    tr.add_argument("--max-restarts", type=int, default=None, metavar="R",
                    help="with --nproc: restart the worker group up to R times when a worker fails (default 0; "
                         f"with --nnodes {ELASTIC_RESTARTS}: each lost node is one)")
    tr.add_argument("--nnodes", default=None, metavar="MIN:MAX",
                    help="with --nproc: this is one of MIN..MAX agents (nodes) of an elastic job; the job goes on "
                         "at the same global batch when nodes leave or join (docs/elastic.md)")
    tr.add_argument("--rdzv-endpoint", default="127.0.0.1:29400", metavar="HOST:PORT",
                    help="with --nnodes: where the agents meet (c10d rendezvous; the first agent there hosts it)")
    tr.add_argument("--rdzv-id", default=None, metavar="ID",
                    help="with --nnodes (required): the job's rendezvous id, the same for all its agents, new and hard to "
                         "guess for each job (docs/security.md)")
    tr.add_argument("--verbose", action="store_true",
                    help="with --nproc: show the workers' stderr (tracebacks, warnings) as they write it, and the "
                         "hang doctor's whole report after a failure; otherwise both are in <run dir>/debug/")
    tr.add_argument("--fresh", action="store_true",
                    help="with --nproc or alone: train from step 0 in a new run directory beside the run this config "
                         "names (<run name>-2, -3, ...), keeping that run; without it an unfinished run resumes")
    tr.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    tr.set_defaults(func=_train)


@dataclass(frozen=True)
class Command:
    """One `shardlab` command: its line in `shardlab --help`, and how its parser is added. The parser
    is built only for the command being run: building it imports the command's module, and most
    import torch, which `shardlab --help` and `shardlab configs` must not wait for."""

    help: str
    add: Callable[[argparse._SubParsersAction], None]


def _module_command(name: str, help_text: str, module_name: str) -> Command:
    """A command whose module documents it (its docstring), adds its arguments and runs it."""
    def add(sub: argparse._SubParsersAction) -> None:
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return Command(help_text, add)


def _adds_itself(help_text: str, module_name: str, function: str) -> Command:
    """A command whose module adds its own parser (deploy's render/submit, export's three, doctor);
    the help text here is what that parser says (tests/test_cli_fast.py checks it)."""
    return Command(help_text, lambda sub: getattr(importlib.import_module(module_name), function)(sub))


def _add_configs_parser(sub: argparse._SubParsersAction) -> None:
    co = sub.add_parser("configs", help=COMMANDS["configs"].help,
                        description="The example configs shipped inside the package; `shardlab train NAME` runs one.")
    co.add_argument("name", nargs="?", metavar="NAME", help="print this config's YAML")
    co.set_defaults(func=_configs)


def _add_verify_parser(sub: argparse._SubParsersAction) -> None:
    from shardlab import verify

    ve = sub.add_parser("verify", help=COMMANDS["verify"].help,
                        description="Prove the config trains on N ranks exactly as one process would: step "
                                    "by step, every gradient and parameter by name, in float64.",
                        epilog=verify.command.EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_arguments(ve)
    ve.set_defaults(func=verify.run)


# name -> Command, in the order `shardlab --help` lists them.
COMMANDS: dict[str, Command] = {
    "train": Command("train a model on N local workers, or as one worker of a launched job", _add_train_parser),
    "configs": Command("list the example configs shipped with shardlab, or print one", _add_configs_parser),
    "prepare": _module_command("prepare", "tokenize documents into memory-mapped token shards (data.source=tokens)",
                               "shardlab.data.prepare"),
    "data": _module_command("data", "look into a prepared corpus: `shardlab data inspect DATA_DIR`",
                            "shardlab.data.describe"),
    "bench": _module_command("bench", "measure every engine at every world size, beside the theory", "shardlab.bench"),
    "plan": _module_command("plan", "predict peak memory per rank of every engine on a GPU, and step time",
                            "shardlab.plan"),
    "verify": Command("prove the config trains on N ranks exactly as one process would", _add_verify_parser),
    "render": _adds_itself("write slurm / k8s / accelerate files for a config", "shardlab.deploy", "add_render_parser"),
    "submit": _adds_itself("render, then submit (slurm, k8s)", "shardlab.deploy", "add_submit_parser"),
    "export": _adds_itself("consolidate a sharded checkpoint into one safetensors file", "shardlab.export",
                           "add_export_parsers"),
    "generate": _adds_itself("sample text from a trained or exported model", "shardlab.export", "add_export_parsers"),
    "eval": _adds_itself("validation loss of a run's checkpoint or an exported model", "shardlab.export",
                         "add_export_parsers"),
    "doctor": _adds_itself("diagnose a hung or failed run: the stuck rank and where every rank waits",
                           "shardlab.doctor.cli", "add_doctor_parser"),
    "report": _module_command("report", "one HTML file on where a run's time and memory went",
                              "shardlab.observe.report"),
    "trace": _module_command("trace", "every rank's phases and collectives as one Chrome trace (Perfetto)",
                             "shardlab.observe.trace"),
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser (every subcommand's too: subparsers take their parent's class) whose
    errors read as the rest of the CLI's do: `error: <cause>` on the first line, the usage after."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n{self.format_usage()}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `shardlab` parser, with the whole parser of `command` (None: no command's options, as
    `shardlab --help` needs) and one line for each of the others."""
    import shardlab

    parser = _Parser(
        prog="shardlab",
        description="Sharded data-parallel training on PyTorch: DDP, ZeRO-3 and FSDP written from scratch, "
                    "beside PyTorch's DDP and FSDP2, behind one config.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `shardlab COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"shardlab {shardlab.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if command in COMMANDS:
        COMMANDS[command].add(sub)
    for name, cmd in COMMANDS.items():
        if name not in sub.choices:  # listed only: its options come when it is the command run
            sub.add_parser(name, help=cmd.help)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The command an argument list runs: its first word that is no option (the top level's
    options, -h and --version, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(_command_of(sys.argv[1:] if argv is None else argv))
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
    try:
        return int(args.func(args) or 0)
    except _usable_errors() as e:  # a checkpoint or data that cannot be used: the message says what to do
        # One write of the whole line: workers that refuse a checkpoint together share the launcher's
        # stderr, and print's two writes (text, then newline) interleave: "error: Aerror: B" on one line.
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        return 1


def _usable_errors() -> tuple[type[Exception], ...]:
    """The errors whose message is the whole answer: a checkpoint or data that cannot be used.
    Read after the command ran: a DataError can only come from a command that imported its
    module, and importing it first would import torch for every command."""
    from shardlab.errors import CheckpointError

    shards = sys.modules.get("shardlab.data.shards")
    return (CheckpointError,) + ((shards.DataError,) if shards is not None else ())


if __name__ == "__main__":
    sys.exit(main())
