"""`shardlab plan`'s verdict per engine on a GPU (fits or not, and what would change it), the
command's arguments, and its report (tables or JSON)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from typing import Any

from shardlab.config import Config, ConfigError, load_config
from shardlab.data.loader import layout_for
from shardlab.engines import STRATEGIES, engine_class
from shardlab.plan.allocator import reserved
from shardlab.plan.catalogue import GPU, GPUS, INTERCONNECTS, default_link, usable_bytes
from shardlab.plan.model import engine_config, param_count
from shardlab.plan.predict import (
    CHUNKED_LOSS,
    PROBE_KINDS,
    SHARDED_ACCUMULATION,
    Prediction,
    accumulation,
    laid_out,
    predict_all,
)
from shardlab.plan.traffic import hiding_limit, step_time


def verdict(cfg: Config, p: Prediction, gpu: GPU, others: dict[str, Prediction], world: int) -> dict[str, Any]:
    usable = usable_bytes(gpu)
    precision_problem = None
    if not gpu.bf16 and "bf16" in (cfg.train.precision, cfg.parallel.mixed_precision):
        precision_problem = (f"{gpu.name} has no bf16 (Turing): use train.precision=fp16 "
                             "parallel.mixed_precision=fp16 (dynamic loss scaling turns on with it)")
    fits = p.peak_bytes <= usable and precision_problem is None and p.probed
    out: dict[str, Any] = {"usable_bytes": usable, "fits": fits, "margin_bytes": usable - p.peak_bytes,
                           "changes": [], **fit_limits(cfg, p, usable)}
    if not fits and p.probed:
        out["cheapest_change"] = cheapest_change(cfg, p, usable, others, world)
    ch = out["changes"]
    if precision_problem:
        ch.append(precision_problem)
    if p.peak_bytes <= usable:
        return out
    sharded_state, rest = _state_and_rest(p)
    if engine_class(p.engine).grads_sharded and sharded_state > 0:
        need = ranks_to_fit(p, usable, world)
        if need:
            ch.append(f"more ranks: about {need} in all (model state {sharded_state / 2**30:.1f} GiB/rank now "
                      f"scales as 1/N; the other {rest / 2**30:.1f} GiB do not); check with --nproc")
        else:
            ch.append(f"more ranks alone cannot help: {rest / 2**30:.1f} GiB of the peak do not shrink with N")
    else:
        fitting = [e for e, q in others.items() if q.probed and q.peak_bytes <= usable]
        sharded = "/".join(e for e in STRATEGIES if engine_class(e).grads_sharded)
        ch.append("a sharded engine: " + (", ".join(f"{e} ({others[e].peak_bytes / 2**30:.1f} GiB)" for e in fitting)
                                           if fitting else f"{sharded} (none fits at this N either)"))
    for change, peak in p.alternatives.items():
        if peak < p.peak_bytes:
            ch.append(f"{change}: {peak / 2**30:.1f} GiB (probed; {_why(change, cfg, world)}: docs/training.md)")
    whole = without_accumulation(cfg, p, world)
    if whole:
        ch.append(_no_accumulation(p, whole))
    act = p.parts["activations"]
    if act > 0.1 * p.peak_bytes and cfg.train.activation_checkpointing != "full":
        ch.append(f"train.activation_checkpointing=full (activations are {act / 2**30:.1f} GiB of the peak; it "
                  "keeps each block's input, at ~33% more compute)" + (
                      "; or selective, which keeps every other matmul output and recomputes the rest (docs/compile.md)"
                      if cfg.train.activation_checkpointing == "none" else ""))
    b = out["max_micro_batch"] or 0
    if b >= 1 and cfg.train.micro_batch_size > 1:
        ch.append(f"a smaller micro batch: train.micro_batch_size={min(b, cfg.train.micro_batch_size - 1)} "
                  "(activations scale linearly; keep global_batch_size by accumulation)")
    if cfg.train.precision == "fp32" and cfg.parallel.mixed_precision == "fp32":
        if gpu.bf16:
            ch.append("bf16: train.precision=bf16 parallel.mixed_precision=bf16 (about halves activations and "
                      "gathered parameters; shards, gradients and Adam state stay fp32)")
        else:
            ch.append(f"{gpu.name} has no bf16: train.precision=fp16 parallel.mixed_precision=fp16 with loss "
                      "scaling (about halves activations and gathered parameters)")
    return out


def fit_limits(cfg: Config, p: Prediction, usable: int) -> dict[str, int | None]:
    """The largest micro batch (at this sequence length) and the largest sequence length (at this
    micro batch) whose peak fits: activations are linear in tokens per micro batch (the quadratic
    attention term is not modelled: docs/memory.md), everything else stays. None: not probed."""
    act = p.parts.get("activations", 0)
    if not p.probed or act <= 0:
        return {"max_micro_batch": None, "max_seq_len": None}
    room = usable - (p.peak_bytes - act)
    per_token = act / (cfg.train.micro_batch_size * cfg.data.seq_len)
    tokens = int(room // per_token) if room > 0 else 0
    return {"max_micro_batch": tokens // cfg.data.seq_len, "max_seq_len": tokens // cfg.train.micro_batch_size}


def without_accumulation(cfg: Config, p: Prediction, world: int) -> tuple[int, float] | None:
    """(micro batch, peak) of the same global batch in one micro batch per rank, when the step
    accumulates and the engine keeps gradients unsharded between micro batches (inside `no_sync`,
    parallel.accumulate=local): those go, activations grow with the micro batch. None where there
    is nothing to gain."""
    t = cfg.train
    whole = t.global_batch_size // world
    held = p.parts.get("unsharded_grads", 0)
    if whole <= t.micro_batch_size or held <= 0 or cfg.parallel.accumulate == "sharded":
        return None
    act = p.parts.get("activations", 0)
    return whole, p.peak_bytes - held + act * (whole / t.micro_batch_size - 1)


def cheapest_change(cfg, p: Prediction, usable: int, others: dict[str, Prediction], world: int) -> str:
    """The first change that fits, cheapest first: the chunked loss (the same loss and gradients,
    probed beside the config: `Prediction.alternatives`), another engine at the same settings (no cost
    beyond its own speed), sharded accumulation (probed beside the config too: k x the gradient
    traffic, often hidden behind compute), the global batch in one micro batch per rank (no
    accumulation, so no gradients held unsharded between micro batches), a smaller micro batch with
    accumulation (the same global batch, less overlap), more ranks (more GPUs), CPU offload (the
    optimizer step on the host: the slowest). Activation checkpointing is not among them: what it
    keeps is known only by probing again, so it stays a `changes` suggestion (plan again with it)."""
    chunked = p.alternatives.get(CHUNKED_LOSS)
    if chunked is not None and chunked <= usable:  # the same loss and gradients, nothing else changes
        return f"{CHUNKED_LOSS} ({chunked / 2**30:.2f} GiB)"
    fitting = sorted((q.peak_bytes, e) for e, q in others.items() if q.probed and q.peak_bytes <= usable)
    if fitting:
        return f"parallel.strategy={fitting[0][1]} ({fitting[0][0] / 2**30:.2f} GiB)"
    sharded = p.alternatives.get(SHARDED_ACCUMULATION)
    if sharded is not None and sharded <= usable:
        return f"{SHARDED_ACCUMULATION}: fits ({sharded / 2**30:.2f} GiB), {_why(SHARDED_ACCUMULATION, cfg, world)}"
    whole = without_accumulation(cfg, p, world)
    if whole and whole[1] <= usable:
        return _no_accumulation(p, whole)
    limits = fit_limits(cfg, p, usable)
    if limits["max_micro_batch"]:
        return f"train.micro_batch_size={min(limits['max_micro_batch'], cfg.train.micro_batch_size - 1)}"
    need = ranks_to_fit(p, usable, world)
    if need:
        return f"more ranks: about {need} in all"
    if "offload" in engine_class(p.engine).options and _state_and_rest(p)[1] < usable:
        return "parallel.offload=cpu"
    return "none of engine, micro batch, ranks or offload fits alone"


def _why(change: str, cfg: Config, world: int) -> str:
    """What a probed alternative (`Prediction.alternatives`) saves, and what it costs."""
    if change == SHARDED_ACCUMULATION:
        return (f"{accumulation(cfg, world)}x gradient traffic; no gradient kept unsharded between micro batches")
    return "the logits are never held whole"


def _state_and_rest(p: Prediction) -> tuple[int, int]:
    """(model state at the peak, the rest of the peak)."""
    state = p.parts["params"] + p.parts["grads"] + p.parts["optimizer"]
    return state, p.peak_bytes - state


def ranks_to_fit(p: Prediction, usable: int, world: int) -> int | None:
    """Ranks in all at which a sharded engine's model state (1/N) leaves room for the rest of its
    peak (which does not shrink with N); None: more ranks alone cannot make it fit."""
    state, rest = _state_and_rest(p)
    if not engine_class(p.engine).grads_sharded or state <= 0 or rest >= usable:
        return None
    return math.ceil(world * state / (usable - rest))


def _no_accumulation(p: Prediction, whole: tuple[int, float]) -> str:
    return (f"train.micro_batch_size={whole[0]} (no accumulation: the {p.parts['unsharded_grads'] / 2**30:.2f} GiB "
            f"of gradients kept unsharded between micro batches go; about {whole[1] / 2**30:.2f} GiB)")


# -- the command -------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.micro_batch_size=2")
    p.add_argument("--gpu", required=True, choices=[*GPUS, "cpu"],
                   help="the GPU each rank runs on; cpu: this machine, its figures measured here (plan/cpu.py)")
    p.add_argument("--nproc", type=int, required=True, metavar="N", help="ranks (GPUs) per node")
    p.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes (world size = N x K)")
    p.add_argument("--interconnect", default=None, choices=list(INTERCONNECTS),
                   help="link between ranks for the time prediction (default: the GPU's own within a node: "
                        "T4 pcie-gen3, L4 pcie-gen4, A100 nvlink3, H100/H200 nvlink4; across nodes T4 gke-n1-t4, "
                        "L4 gke-g2-l4, others infiniband-400)")
    p.add_argument("--engines", default=None, help="comma-separated engines (default: all that apply)")
    p.add_argument("--probe", default="auto", choices=PROBE_KINDS,
                   help="what the probes run on: fake tensors (FakeTensorMode: real shapes, no data) for every "
                        "engine that can (auto, the default: every built-in one; torch-ddp's C++ reducer with the three "
                        "values it reads answered, plan/fake_ddp.py), fake only, or real tensors at a reduced "
                        "micro batch (torch-ddp on a real one-rank gloo group)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
        if args.nproc < 1 or args.nodes < 1:
            raise ConfigError(f"--nproc and --nodes must be >= 1, got {args.nproc} and {args.nodes}")
        engines = args.engines.split(",") if args.engines else None
        if engines:
            bad = [e for e in engines if e not in STRATEGIES]
            if bad:
                raise ConfigError(f"--engines: unknown {', '.join(bad)}; valid: {', '.join(STRATEGIES)}")
        world = args.nproc * args.nodes
        t = cfg.train
        lowered = layout_for(t.global_batch_size, t.micro_batch_size, world).note(t.global_batch_size)
        cfg = laid_out(cfg, world)   # what the run trains at this world size, as plan probes it
        preds = predict_all(cfg, world, engines, per_node=args.nproc, probe=getattr(args, "probe", "auto"))  # validates every engine before probing
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpu, machine = _device(args.gpu, world)
    link = INTERCONNECTS[args.interconnect or default_link(gpu, args.nodes)]
    report: dict[str, Any] = {"gpu": dataclasses.asdict(gpu), "usable_bytes": usable_bytes(gpu), "world": world,
                              "layout_note": lowered,
                              "nodes": args.nodes, "interconnect": dataclasses.asdict(link), "engines": {}}
    for e, p in preds.items():
        c = engine_config(cfg, e, world, args.nproc)
        v = verdict(c, p, gpu, preds, world)
        ts = step_time(c, e, world, link, gpu, None, args.nodes, p.step_flops, p.census, machine)
        ts["comm_stops_hiding_at_nodes"] = hiding_limit(c, e, args.nproc, link, ts["compute_s"], world)
        r = reserved(p.parts, gpu.name, world)
        report["engines"][e] = {**p.to_dict(), "reserved_bytes": r.reserved_bytes, "device_bytes": r.device_bytes,
                                "reserved_parts": r.parts, "verdict": v, "time": ts}
    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return 0
    print_report(cfg, report)
    return 0


def _device(name: str, world: int):
    """(the GPU entry for the memory verdict, the clock's machine: None for a catalogue GPU's own)."""
    if name != "cpu":
        return GPUS[name], None
    from shardlab.plan.cpu import cpu_gpu, cpu_machine  # deferred: it measures this machine

    return cpu_gpu(), cpu_machine(world)


_UNIT = [2**30, "GiB"]


def _gib(b: float) -> str:
    return f"{b / _UNIT[0]:.2f}"


def print_report(cfg: Config, report: dict[str, Any]) -> None:
    gpu = report["gpu"]
    print(f"shardlab plan: {cfg.model.name} ({param_count(cfg) / 1e6:.1f} M parameters), micro batch "
          f"{cfg.train.micro_batch_size} x {cfg.data.seq_len}, global batch {cfg.train.global_batch_size}, "
          f"{report['world']} rank(s) = {report['world'] // report['nodes']} x {report['nodes']} node(s) of "
          f"{gpu['name']} ({gpu['memory_bytes'] / 1e9:.0f} GB, usable {_gib(report['usable_bytes'])} GiB)")
    if report.get("layout_note"):
        print(report["layout_note"])
    small = max(r["peak_bytes"] for r in report["engines"].values()) < 2**30
    _UNIT[:] = [2**20, "MiB"] if small else [2**30, "GiB"]
    print(f"predicted peak per rank, {_UNIT[1]}, by part:")
    cols = ["params", "gathered_params", "grads", "unsharded_grads", "optimizer", "activations", "comm"]
    w = max(11, *(len(e) for e in report["engines"]))  # the engine column: as wide as the longest name
    head = (f"{'engine':{w}s} {'peak':>7s} " + " ".join(f"{c[:10]:>10s}" for c in cols)
            + f" {'reserved':>9s} {'device':>8s}  verdict")
    print(head)
    for e, r in report["engines"].items():
        v = r["verdict"]
        word = (f"fits, {_gib(v['margin_bytes'])} {_UNIT[1]} spare" if v["fits"] else
                ("does not fit" if r["probed"] else "does not fit (lower bound)" if v["margin_bytes"] < 0
                 else "unknown (not probed)"))
        print(f"{e:{w}s} {_gib(r['peak_bytes']):>7s} " + " ".join(f"{_gib(r['parts'][c]):>10s}" for c in cols)
              + f" {_gib(r['reserved_bytes']):>9s} {_gib(r['device_bytes']):>8s}  {word}")
    print("  peak: live tensor bytes; reserved: the CUDA caching allocator's peak (torch.cuda.max_memory_reserved); "
          "device: reserved + CUDA context + NCCL (nvidia-smi) (docs/memory.md, [Note: live, reserved, device])")
    for e, r in report["engines"].items():
        for n in r["notes"]:
            print(f"  {e}: {n}")
        v = r["verdict"]
        if v["max_micro_batch"] == 0:
            print(f"  {e}: no micro batch fits at this seq_len: the rest of the peak alone exceeds the usable memory")
        elif v["max_micro_batch"] is not None:
            print(f"  {e}: fits up to train.micro_batch_size={v['max_micro_batch']} at this seq_len, "
                  f"data.seq_len={v['max_seq_len']} at this micro batch")
        if v.get("cheapest_change"):
            print(f"  {e}: cheapest change that fits: {v['cheapest_change']}")
        for c in v["changes"]:
            print(f"  {e}: change: {c}")
    print(f"time per step on {report['interconnect']['name']} (alpha {report['interconnect']['alpha_s'] * 1e6:.0f} us, "
          f"{report['interconnect']['bandwidth'] / 1e9:.1f} GB/s), each operation of the probed step at "
          f"{gpu['name']}'s rate for its kind (docs/plan.md, \"Step time\"):")
    for e, r in report["engines"].items():
        t = r["time"]
        lim = t["comm_stops_hiding_at_nodes"]
        # with --gpu cpu beyond one rank the collectives are timed inside the measured narrow step (plan/cpu.py):
        # they are part of `host`, and the link prices none of them
        in_host = t.get("comm_in_host", False)
        comm = f"{'in host':>9s}   " if in_host else f"{t['comm_s'] * 1e3:9.1f} ms"
        verdict = "measured in host" if in_host else ("hidden" if t["comm_hidden"] else "EXPOSED")
        print(f"  {e:{w}s} compute {t['compute_s'] * 1e3:9.1f} ms  comm {comm}  step "
              f"{t['step_s'] * 1e3:9.1f} ms  {t['tokens_per_s'] or 0:12.0f} tokens/s "
              f"({(t['tokens_per_s'] or 0) / report['world']:.0f} per rank, {t['flops_per_token']:.3g} FLOP/token)  comm "
              f"{verdict}" + (f"; stops hiding at {lim} node(s)" if lim else "; hidden up to 1024 nodes"))
    for e, r in report["engines"].items():
        parts = r["time"]["parts_s"]
        print(f"  {e}: compute by kind, ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items())
              + f"; least sure: {r['time']['least_sure']}")
    print("  FLOP/token: counted on the probe's own step (matmuls, attention, recomputation) where it ran at the real "
          "shape, else 6 x parameters (+ what checkpointing recomputes) (docs/memory.md)")
