"""The training loop. It never asks which engine it drives: the engine hides all
communication behind `parallelize`, `no_sync`, `clip_grad_norm_` and `full_state_dict`.

One step = one global batch = world_size x accumulation x micro_batch_size samples:
  for each micro batch: forward, loss / accumulation, backward (inside no_sync but the last)
  clip the global gradient norm, optimizer step, LR schedule step
  the logged loss is the global mean over all ranks' samples (one tiny all-reduce)
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardlab
from shardlab import metrics as M
from shardlab.config import Config, dump_config, validate_for_world
from shardlab.data import GlobalBatchSampler, build_datasets, collate
from shardlab.engines import SHARDED_STRATEGIES, engine_class, engine_of, optimizer_state_bytes
from shardlab.engines.api import MixedPrecision
from shardlab.models import build_model, count_parameters
from shardlab.runtime import Runtime, all_gather_object, hostname, init_runtime, seed_everything, shutdown


@dataclass
class TrainState:
    """Everything besides model and optimizer that a resume must restore. The data position
    is the step: the sampler's batch for step s is a pure function of (seed, s)."""

    step: int = 0
    losses: list[float] = field(default_factory=list)


def run_dir(cfg: Config) -> str:
    return os.path.join(cfg.output.dir, cfg.output.run_name)


def build_model_for(cfg: Config, vocab_size: int | None, device: str) -> nn.Module:
    m = cfg.model
    if m.name == "gpt":
        overrides = {k: getattr(m, k) for k in ("n_layer", "n_head", "n_embd", "block_size")}
        return build_model("gpt", seed=cfg.seed, device=device, preset=m.preset, dropout=m.dropout,
                           vocab_size=m.vocab_size or vocab_size, **overrides)
    if m.name == "resnet":
        return build_model("resnet", seed=cfg.seed, device=device, blocks=tuple(m.resnet_blocks),
                           width=m.resnet_width, num_classes=m.num_classes)
    return build_model("mlp", seed=cfg.seed, device=device, sizes=tuple(m.mlp_sizes))


def engine_options(cfg: Config) -> dict[str, Any]:
    p = cfg.parallel
    offered = {
        "reshard_after_forward": p.reshard_after_forward,
        "mixed_precision": MixedPrecision.parse(p.mixed_precision),
        "bucket_size_bytes": int(p.bucket_size_mb * 2**20),
        "prefetch": p.prefetch,
    }
    accepted = engine_class(p.strategy).options
    return {k: v for k, v in offered.items() if k in accepted}


def make_optimizer(cfg: Config, params) -> torch.optim.Optimizer:
    t = cfg.train
    params = list(params)
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    # foreach=False: the same kernels whatever the number or shape of the (sharded) tensors,
    # so every engine's update is the same arithmetic as single's.
    return torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                             foreach=False)


def make_schedule(cfg: Config, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _autocast(cfg: Config, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.train.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _all_reduce_mean(value: torch.Tensor, rt: Runtime) -> torch.Tensor:
    if rt.distributed and rt.world_size > 1:
        dist.all_reduce(value)
        value = value / rt.world_size
    return value


def _comm_since(before: dict | None, after: dict | None) -> dict | None:
    if after is None:
        return None
    before = before or {}
    return {kind: {k: v - before.get(kind, {}).get(k, 0) for k, v in totals.items()} for kind, totals in after.items()}


@torch.no_grad()
def evaluate(model: nn.Module, dataset, cfg: Config, rt: Runtime, sampler_seed: int) -> float | None:
    """Mean loss over up to eval_batches global batches of the validation set, split over ranks."""
    t = cfg.train
    if dataset is None or len(dataset) < t.global_batch_size:
        return None  # not one whole global batch to split over the ranks
    was_training = model.training
    model.eval()
    per_rank = t.global_batch_size // rt.world_size
    sampler = GlobalBatchSampler(len(dataset), t.global_batch_size, sampler_seed, shuffle=False)
    total = torch.zeros(2, device=rt.device)
    for b in range(min(t.eval_batches, sampler.steps_per_epoch)):
        idx = sampler.rank_indices(b, rt.rank, rt.world_size)
        for i in range(0, per_rank, t.micro_batch_size):
            x, y = collate(dataset, idx[i:i + t.micro_batch_size])
            with _autocast(cfg, rt.device):
                loss = model(x.to(rt.device), y.to(rt.device))
            total += torch.stack([loss.float() * len(x), torch.tensor(float(len(x)), device=rt.device)])
    if rt.distributed and rt.world_size > 1:
        dist.all_reduce(total)
    model.train(was_training)
    return (total[0] / total[1]).item()


def train(cfg: Config, rt: Runtime | None = None) -> dict[str, Any]:
    """Train with `cfg` in this worker; returns the metrics (written by rank 0)."""
    t0 = time.perf_counter()
    rt = rt or init_runtime(cfg.parallel.backend, cfg.parallel.timeout_s,
                            force_group=cfg.parallel.strategy != "single")
    validate_for_world(cfg, rt.world_size)
    seed_everything(cfg.seed)
    out_dir = run_dir(cfg)
    t = cfg.train
    accumulation = t.global_batch_size // (rt.world_size * t.micro_batch_size)

    data = build_datasets(cfg)
    # Sharded engines materialize only their shard from the meta device; the others materialize whole.
    model = build_model_for(cfg, data.vocab_size, "meta")
    n_params = count_parameters(model)
    model = shardlab.parallelize(model, cfg.parallel.strategy, device=rt.device,
                                 activation_checkpointing=t.activation_checkpointing, **engine_options(cfg))
    engine = engine_of(model)
    if not engine.local_parameters():
        raise ValueError(f"rank {rt.rank} holds no parameter with parallel.strategy={cfg.parallel.strategy} at world "
                         f"size {rt.world_size}: the model has fewer parameter tensors than ranks. Use fewer "
                         "workers or parallel.strategy=fsdp, which slices every tensor.")
    opt = make_optimizer(cfg, model.parameters())
    sched = make_schedule(cfg, opt)
    state = TrainState()

    manager = None
    if cfg.checkpoint.every_steps > 0 or cfg.checkpoint.resume != "none":
        # sharded save and exact resume: docs/checkpointing.md
        from shardlab.checkpoint import CheckpointManager

        manager = CheckpointManager.from_config(cfg, out_dir, rt)
    if manager is not None:
        manager.maybe_resume(model, opt, sched, state)

    hosts = all_gather_object(hostname(), rt)
    if rt.is_main:
        os.makedirs(out_dir, exist_ok=True)
        M.write_json_atomic(os.path.join(out_dir, "run_args.json"), M.run_args(
            cfg.to_dict(), rt.world_size, hosts,
            {"num_parameters": n_params, "accumulation_steps": accumulation, "data": data.info,
             "restart_count": rt.restart_count, "resumed_from_step": state.step}), default=str)
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            f.write(dump_config(cfg))

    writer = None
    if rt.is_main and cfg.output.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(os.path.join(out_dir, "tensorboard"))

    sampler = GlobalBatchSampler(len(data.train), t.global_batch_size, cfg.seed, cfg.data.shuffle)
    timer = M.StepTimer(warmup=1)
    bar = None
    if rt.is_main and cfg.output.progress:
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=state.step, desc=f"{cfg.parallel.strategy} x{rt.world_size}",
                   unit="step", dynamic_ncols=True)
    model.train()
    comm_before_loop = engine.comm_stats()  # wrap-time broadcasts and resume are not step traffic
    val_losses: dict[int, float] = {}
    train_seconds = 0.0
    steps_run = 0
    while state.step < t.steps:
        step_start = time.perf_counter()
        idx = sampler.rank_indices(state.step, rt.rank, rt.world_size)
        local_loss = torch.zeros((), device=rt.device)
        for i in range(accumulation):
            x, y = collate(data.train, idx[i * t.micro_batch_size:(i + 1) * t.micro_batch_size])
            x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
            sync = i == accumulation - 1
            with (contextlib.nullcontext() if sync else shardlab.no_sync(model)), _autocast(cfg, rt.device):
                loss = model(x, y) / accumulation
            loss.backward()
            local_loss += loss.detach().float()
        grad_norm = shardlab.clip_grad_norm_(model, t.grad_clip if t.grad_clip > 0 else float("inf"))
        opt.step()
        sched.step()
        if state.step + 1 == t.steps:  # measured while gradients and optimizer state both exist
            state_bytes = {**engine.model_state_bytes(), "optimizer": optimizer_state_bytes(opt)}
        opt.zero_grad(set_to_none=True)
        global_loss = _all_reduce_mean(local_loss, rt).item()
        step_time = time.perf_counter() - step_start
        timer.add(step_time)
        train_seconds += step_time
        steps_run += 1
        state.step += 1
        state.losses.append(global_loss)
        if not math.isfinite(global_loss):
            if bar is not None:
                bar.close()
            raise FloatingPointError(
                f"the loss is {global_loss} at step {state.step}: training stopped. Lower train.lr, "
                "enable train.grad_clip, or check the data; the last good checkpoint (if any) is kept.")
        samples_s = t.global_batch_size / step_time
        if writer is not None and state.step % t.log_every == 0:
            writer.add_scalar("train/loss", global_loss, state.step)
            writer.add_scalar("train/lr", sched.get_last_lr()[0], state.step)
            writer.add_scalar("train/grad_norm", float(grad_norm), state.step)
            writer.add_scalar("perf/samples_per_s", samples_s, state.step)
        if bar is not None:
            post = {"loss": f"{global_loss:.4f}", "samples/s": f"{samples_s:.1f}"}
            if data.tokens_per_sample:
                post["tok/s"] = f"{samples_s * data.tokens_per_sample:.0f}"
            bar.set_postfix(post)
            bar.update(1)
        if t.eval_every and state.step % t.eval_every == 0 and state.step < t.steps:
            val_losses[state.step] = evaluate(model, data.val, cfg, rt, cfg.seed + 1)
            if writer is not None and val_losses[state.step] is not None:
                writer.add_scalar("val/loss", val_losses[state.step], state.step)
        if manager is not None:
            manager.maybe_save(model, opt, sched, state)
    if bar is not None:
        bar.close()
    train_comm = _comm_since(comm_before_loop, engine.comm_stats())  # before the final evaluation's traffic
    if manager is not None:
        manager.finalize(model, opt, sched, state)
    val_losses[state.step] = evaluate(model, data.val, cfg, rt, cfg.seed + 1)

    if steps_run == 0:  # resumed at the last step: nothing trained in this run
        state_bytes = {**engine.model_state_bytes(), "optimizer": optimizer_state_bytes(opt)}
    per_rank = all_gather_object({"peak_memory_bytes": M.peak_memory_bytes(rt.device), "model_state_bytes": state_bytes,
                        "comm": train_comm}, rt)
    wall = time.perf_counter() - t0
    samples = steps_run * t.global_batch_size
    result: dict[str, Any] = {
        "wall_clock_s": wall,
        "train_time_s": train_seconds,
        "steps": state.step,
        "steps_this_run": steps_run,
        "samples_processed": samples,
        "samples_per_s": samples / train_seconds if train_seconds else None,
        "step_time_median_s": timer.median(),
        "step_times_s": timer.times,
        "world_size": rt.world_size,
        "strategy": cfg.parallel.strategy,
        "sharded": cfg.parallel.strategy in SHARDED_STRATEGIES,
        "device": M.device_name(rt.device),
        "num_parameters": n_params,
        "peak_memory_bytes": [r["peak_memory_bytes"] for r in per_rank],
        "model_state_bytes": [sum(r["model_state_bytes"].values()) for r in per_rank],
        "model_state_breakdown": [r["model_state_bytes"] for r in per_rank],
        "comm_bytes": [r["comm"] for r in per_rank],  # per collective kind, training steps only; null: not counted
        "final_loss": state.losses[-1] if state.losses else None,
        "losses": state.losses,
        "val_loss": val_losses[state.step],
        "val_losses": val_losses,
        "restart_count": rt.restart_count,
    }
    if data.tokens_per_sample:
        result["tokens_processed"] = samples * data.tokens_per_sample
        result["tokens_per_s"] = result["tokens_processed"] / train_seconds if train_seconds else None
    if rt.is_main:
        M.write_json_atomic(os.path.join(out_dir, "metrics.json"), result, default=str)
    if writer is not None:
        writer.close()
    return result


def print_summary(result: dict[str, Any], out_dir: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"shardlab: {result['strategy']} on {result['world_size']} worker(s), {result['device']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    gib = 2**30

    def row(k: str, v: Any) -> None:
        table.add_row(k, v)

    row("steps", str(result["steps"]))
    row("final loss", f"{result['final_loss']:.4f}")
    if result.get("val_loss") is not None:
        row("validation loss", f"{result['val_loss']:.4f}")
    row("samples/s", f"{result['samples_per_s']:.1f}")
    if result.get("tokens_per_s"):
        row("tokens/s", f"{result['tokens_per_s']:.0f}")
    row("median step time", f"{result['step_time_median_s'] * 1000:.1f} ms")
    row("parameters", f"{result['num_parameters'] / 1e6:.2f} M")
    row("model state / rank (params+grads+optim)", ", ".join(f"{b / 2**20:.1f} MiB" for b in result["model_state_bytes"]))
    row("peak memory / rank", ", ".join(f"{b / gib:.2f} GiB" for b in result["peak_memory_bytes"]))
    row("wall clock", f"{result['wall_clock_s']:.1f} s")
    Console().print(table)
    print(f"run directory: {out_dir}")


def worker_main(cfg: Config) -> int:
    """Entry point of one worker process (under shardlab's launcher, torchrun, srun or a pod)."""
    rt = init_runtime(cfg.parallel.backend, cfg.parallel.timeout_s, force_group=cfg.parallel.strategy != "single")
    try:
        if not cfg.output.run_name:
            cfg.output.run_name = _agree_on_run_name(cfg, rt)
        result = train(cfg, rt)
        if rt.is_main:
            print_summary(result, run_dir(cfg))
        return 0
    except (dist.DistBackendError, RuntimeError) as e:
        if rt.distributed and _is_peer_failure(e):
            import sys

            print(f"error: rank {rt.rank}: lost contact with another worker ({str(e).splitlines()[0][:200]}). "
                  f"Another rank died or hung (the launcher's log names the first to fail). With "
                  f"--max-restarts the group restarts and resumes from the last complete checkpoint; otherwise "
                  f"re-run with checkpoint.resume=auto. Collectives time out after parallel.timeout_s="
                  f"{cfg.parallel.timeout_s:g} s.", file=sys.stderr)
        raise
    finally:
        shutdown()


def _is_peer_failure(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, dist.DistBackendError) or any(
        s in text for s in ("Connection reset", "Connection closed", "Broken pipe", "timed out", "Timeout",
                            "connectFullMesh", "Connection refused"))


def default_run_name(cfg: Config) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"{cfg.model.name}-{cfg.parallel.strategy}-{stamp}"


def _agree_on_run_name(cfg: Config, rt: Runtime) -> str:
    """Outside shardlab's launcher nobody chose a run name: take a stable job id when the
    launcher offers one (so restarts find their checkpoints), else rank 0's timestamp."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("JOB_NAME")
    if job:
        return f"{cfg.model.name}-{cfg.parallel.strategy}-{job}"
    return all_gather_object(default_run_name(cfg), rt)[0]
