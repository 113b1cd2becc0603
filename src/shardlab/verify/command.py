"""`shardlab verify`: check, before spawning anything, build the plan, start the workers, print
the report. Exit codes: 0 equal, 1 not equal (or the runs could not finish), 2 bad input."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
import uuid
from typing import TYPE_CHECKING

from shardlab.engines import ALL_REDUCE, ONE_PROCESS, STRATEGIES, engine_class

if TYPE_CHECKING:
    from shardlab.verify.runs import Plan

EPILOG = """\
examples:
  shardlab verify configs/gpt-tiny.yaml --nproc 2 parallel.strategy=zero3
  shardlab verify configs/resnet-cifar10.yaml --nproc 2 data.source=synthetic model.sync_batchnorm=true
  shardlab verify configs/sft-mistral-tiny.yaml --nproc 2 --against ddp
  shardlab verify my-7b.yaml --nproc 2 --layers 2

Runs the config K steps with its engine on N local workers and, as the reference, one process
whose micro batches are the N ranks' micro batches together; compares loss, gradient norm,
every parameter's gradient and value and every buffer, step by step (docs/verify.md).
Exit code: 0 equal, 1 different, 2 bad input.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. parallel.strategy=zero3")
    p.add_argument("--nproc", type=int, required=True, metavar="N", help="ranks of the engine run (local workers)")
    p.add_argument("--steps", type=int, default=3, metavar="K", help="optimizer steps compared (default 3)")
    p.add_argument("--against", choices=(ONE_PROCESS, ALL_REDUCE), default=ONE_PROCESS,
                   help="the reference: one process (default) or the config under ddp at N ranks")
    p.add_argument("--dtype", choices=("float64", "config"), default="float64",
                   help="float64 (default): both runs in float64, tight tolerance; config: the config's dtypes "
                        "and mixed precision, a tolerance from that dtype")
    p.add_argument("--layers", type=int, default=None, metavar="L",
                   help="cut the model to L blocks as `shardlab plan` does (GPT, HF decoders)")
    p.add_argument("--keep-dropout", action="store_true",
                   help="keep dropout on (it draws different masks per rank, so the runs then differ)")


class BadInput(ValueError):
    pass


def model_depth(cfg) -> int | None:
    """Blocks of a model --layers can cut (`ModelSpec.depth`: GPT's n_layer, an HF decoder's
    layers); None: the model runs whole."""
    from shardlab.models import MODELS

    spec = MODELS[cfg.model.name]
    return spec.depth(cfg.model) if spec.cut_depth is not None else None


def cut_depth(raw: dict, layers: int, tmpdir: str) -> None:
    """--layers: the model of config dict `raw` cut to `layers` blocks, as `shardlab plan` cuts
    its probes (`ModelSpec.cut_depth`)."""
    from shardlab.models import MODELS

    MODELS[raw["model"]["name"]].cut_depth(raw["model"], layers, tmpdir)


def make_plan(cfg, args, workdir: str) -> Plan:
    """The engine's and the reference's configs (validated) and the notes on what verify changed."""
    from shardlab.config import ConfigError, config_from_dict, validate_for_world
    from shardlab.verify.runs import Plan

    n, t = args.nproc, cfg.train
    _check_request(cfg, args)
    validate_for_world(cfg, n)
    raw = cfg.to_dict()
    notes = []
    if args.layers is not None:
        depth = model_depth(cfg)
        if depth is None:
            raise BadInput(f"--layers cuts GPT and HF decoder models; model.name={cfg.model.name} runs whole")
        if not 1 <= args.layers <= depth:
            raise BadInput(f"--layers must be in [1, {depth}] (the model has {depth} blocks), got {args.layers}")
        cut_depth(raw, args.layers, workdir)
        notes.append(f"the model cut to {args.layers} of its {depth} blocks (--layers)"
                     + (", randomly initialized" if cfg.model.name == "hf" and cfg.model.hf_path else ""))
    raw["train"].update(steps=max(t.steps, args.steps), eval_every=0, memory_tracking="none", profile=False)
    raw["checkpoint"].update(every_steps=0, resume="none")
    raw["preemption"]["enabled"] = False
    raw["export"]["format"] = "none"
    raw["output"].update(dir=workdir, run_name="verify", tensorboard=False, trackers=None, progress=False)
    if args.dtype == "float64":
        notes += _in_float64(raw)
    ref = _reference(raw, args.against, n, t.micro_batch_size)
    try:
        engine_cfg, ref_cfg = config_from_dict(raw), config_from_dict(ref)
        validate_for_world(engine_cfg, n)
        validate_for_world(ref_cfg, 1 if args.against == ONE_PROCESS else n)
    except ConfigError as e:
        raise BadInput(str(e)) from None
    return Plan(engine_cfg.to_dict(), ref_cfg.to_dict(), n, args.steps, args.against, args.dtype,
                args.keep_dropout, workdir, tuple(notes))


def _check_request(cfg, args) -> None:
    """What verify itself refuses, before the config's own checks: counts below one, a one-process
    engine to verify, an engine compared with itself."""
    n, p = args.nproc, cfg.parallel
    if n < 1:
        raise BadInput(f"--nproc must be >= 1, got {n}")
    if args.steps < 1:
        raise BadInput(f"--steps must be >= 1, got {args.steps}")
    if not engine_class(p.strategy).distributed:
        distributed = [s for s in STRATEGIES if engine_class(s).distributed]
        raise BadInput("verify compares a distributed engine with one process; set parallel.strategy to one of "
                       f"{', '.join(distributed)}")
    if args.against == p.strategy:
        raise BadInput(f"--against {args.against} compares another engine with {args.against}; with "
                       f"parallel.strategy={p.strategy} use --against {ONE_PROCESS}")


def _in_float64(raw: dict) -> list[str]:
    """The engine's config (`raw`, changed in place) computing and reducing in float64 where it
    would round; the notes saying what changed."""
    notes = []
    mp = raw["parallel"]["mixed_precision"]
    if mp in ("bf16", "fp16"):  # the engine keeps its mixed-precision path, computing in float64
        notes.append(f"parallel.mixed_precision={mp} runs as fp64: the engine's casts and reductions run, in "
                     f"float64 (--dtype config keeps {mp})")
        raw["parallel"]["mixed_precision"] = "fp64"
    rd = raw["parallel"].get("reduce_dtype")
    if rd not in (None, "fp64"):  # a reduction in fp32 or less would round the float64 gradients
        notes.append(f"parallel.reduce_dtype={rd} runs as fp64: the engine reduces in float64 (--dtype config "
                     f"keeps {rd})")
        raw["parallel"]["reduce_dtype"] = "fp64"
    if raw["train"]["precision"] != "fp32":
        notes.append(f"train.precision={raw['train']['precision']}: autocast leaves float64 alone (an fp16 loss "
                     "scaler still scales, exactly: a power of two)")
    return notes


def _reference(raw: dict, against: str, n: int, micro_batch_size: int) -> dict:
    """The reference's config: the engine's, run by `against` (one process: the n ranks' micro
    batches as one), as plain maths."""
    ref = copy.deepcopy(raw)
    ref["parallel"].update(strategy=against, offload="none", shard_size=None)
    if "mixed_precision" not in engine_class(against).options:  # the reference computes in the model's dtype
        ref["parallel"]["mixed_precision"] = "fp32"
    if "accumulate" not in engine_class(against).options:  # it holds whole gradients: nothing to shard
        ref["parallel"]["accumulate"] = "local"
    if against == ONE_PROCESS:
        ref["train"].update(micro_batch_size=n * micro_batch_size, activation_checkpointing="none")
        ref["parallel"]["reduce_dtype"] = None  # one process reduces nothing
    ref["train"].update(compile=False, compile_mode=None)  # the reference is the plain maths; the engine keeps its own
    return ref


# -- running ---------------------------------------------------------------------------------------
def _worker_entry(plan: Plan):
    """One worker under the elastic agent: runtime from the environment, the runs, the report (rank 0)."""
    from shardlab.config import config_from_dict
    from shardlab.loop.runtime import init_runtime, shutdown
    from shardlab.verify.compare import compare
    from shardlab.verify.runs import verify_worker

    p = config_from_dict(plan.engine).parallel
    rt = init_runtime(p.backend, p.timeout_s, force_group=True)
    clean = False
    try:
        report = verify_worker(rt, plan, compare)
        clean = True
        return report
    finally:
        shutdown(clean)


def launch(plan: Plan, timeout_s: float):
    """Start plan.nproc local workers through torchrun's elastic agent; rank 0's report."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from shardlab.loop.runtime import free_port

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.nproc)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=plan.nproc, run_id=f"verify-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                          rdzv_configs={"timeout": int(timeout_s)}, max_restarts=0, monitor_interval=0.2)
    return elastic_launch(config, _worker_entry)(plan)[0]


def run(args: argparse.Namespace) -> int:
    from shardlab.config import ConfigError, load_config
    from shardlab.verify.report import print_report

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardlab-verify-") as workdir:
        try:
            cfg = load_config(args.config, args.overrides)
            plan = make_plan(cfg, args, workdir)
            from shardlab.data import prepare_datasets

            prepare_datasets(cfg)  # once, before the workers (as `shardlab train`)
        except (ConfigError, BadInput, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            report = launch(plan, cfg.parallel.timeout_s)
        except Exception as e:  # noqa: BLE001 - a worker failed: its traceback is above
            print(f"error: verify could not finish: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  file=sys.stderr)
            return 1
    report.seconds["total"] = time.perf_counter() - t0
    print_report(report)
    return 0 if report.equal else 1

