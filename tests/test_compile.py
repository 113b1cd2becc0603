"""torch.compile per unit and activation checkpointing none | full | selective (engines/compile.py)
on every engine: the same numbers as eager, the same names in state dicts, checkpoints and
exports, and less memory where checkpointing promises it.

Compile is slow on 2 cores, so everything compiled runs in as few processes as possible (one
spawn at N=2 for the five distributed engines, this process for `single`, one spawn for the
training loop), each reusing what it compiled: the block's graph is compiled once per process
and dtype and serves every block and every engine of the same shapes.

Tolerances. float32, compiled vs eager, 4 steps of AdamW: the issue's bar, 1e-4 (losses) and the
parity harness's float32 AdamW tolerance (1e-4, parameters). Measured (this machine, 2026-11-23,
every engine at N=2): losses equal to the last bit, parameters 4.4e-6 apart: inductor fuses and
reorders the block's float arithmetic, which Adam turns into parts of an lr-sized step. A
2x gradient moves gpt/AdamW parameters by 6.7e-3 (tests/parity.py). float64, compiled vs
`single` eager: the harness's own 1e-10; measured at most 1.7e-14 (inductor compiles float64
on CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from shardlab.engines.compile import Checkpointing, apply_to_units
from shardlab.models import GPT, GPT_PRESETS
from shardlab.testing import run_workers
from tests.parity import (
    FLOAT32_TOL,
    assert_parity,
    batch,
    build,
    set_mode,
    train_engine,
    train_reference,
)

ENGINES = ("ddp", "zero3", "fsdp", "torch-ddp", "torch-fsdp")
F32 = torch.float32
COMPILED_VS_EAGER_LOSS_RTOL = 1e-4  # the bar: compiled vs eager losses within 1e-4


# -- one spawn at N=2: every engine, compiled vs eager and vs single -----------------------------
def _distributed_runs(rank: int, world: int) -> dict:
    out = {}
    for s in ENGINES:
        out[(s, "f32", "eager")] = train_engine(rank, world, "gpt", s, "adamw", steps=4, dtype=F32)
        out[(s, "f32", "compiled")] = train_engine(rank, world, "gpt", s, "adamw", steps=4, dtype=F32, compile=True)
        out[(s, "f64", "compiled")] = train_engine(rank, world, "gpt", s, "adamw", steps=4, compile=True)
    # eager checkpointing: selective on every engine, full on PyTorch's (ours: tests/test_engine_*.py)
    for s in ENGINES:
        for mode in ("selective", "full") if s.startswith("torch-") else ("selective",):
            out[(s, "f64", f"eager-{mode}")] = train_engine(rank, world, "gpt", s, "adamw", steps=4,
                                                            activation_checkpointing=mode)
    # checkpointing inside the compiled unit: selective on the sharded engines (their hooks
    # re-gather for backward), full on a replicated one
    for s, mode in (("zero3", "selective"), ("fsdp", "selective"), ("torch-fsdp", "selective"), ("ddp", "full")):
        out[(s, "f64", mode)] = train_engine(rank, world, "gpt", s, "adamw", steps=4, compile=True,
                                             activation_checkpointing=mode)
    # accumulation (micro batches of 3 under no_sync), frozen parameters in every unit (LoRA's
    # layout) with selective checkpointing, compiled
    for s in ("zero3", "fsdp"):
        out[(s, "f64", "accumulate")] = train_engine(rank, world, "gpt", s, "sgd", steps=4, micro_batches=2,
                                                     compile=True)
        out[(s, "f64", "frozen")] = train_engine(rank, world, "gpt_frozen", s, "adamw", steps=4, compile=True,
                                                 activation_checkpointing="selective")
    # mixed precision: bf16 gathered parameters and compute, compiled vs eager
    mp = {"mixed_precision": "bf16"}
    out[("fsdp", "bf16", "eager")] = train_engine(rank, world, "gpt", "fsdp", "adamw", steps=4, dtype=F32, **mp)
    out[("fsdp", "bf16", "compiled")] = train_engine(rank, world, "gpt", "fsdp", "adamw", steps=4, dtype=F32,
                                                     compile=True, **mp)
    return out


@pytest.fixture(scope="module")
def distributed():
    return run_workers(2, _distributed_runs, timeout_s=600)[0]


def _assert_close_losses(got: list[float], ref: list[float], rtol: float, label: str) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                               rtol=rtol, atol=0.0, msg=lambda m: f"{label}: losses differ\n{m}")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ENGINES)
def test_compiled_engine_matches_eager_in_float32(distributed, strategy):
    eager, compiled = distributed[(strategy, "f32", "eager")], distributed[(strategy, "f32", "compiled")]
    _assert_close_losses(compiled[0], eager[0], COMPILED_VS_EAGER_LOSS_RTOL, f"{strategy} compiled")
    assert_parity(eager, compiled, f"{strategy} compiled vs eager", **FLOAT32_TOL["adamw"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ENGINES)
def test_compiled_engine_passes_the_float64_harness(distributed, strategy):
    assert_parity(train_reference("gpt", "adamw", steps=4), distributed[(strategy, "f64", "compiled")],
                  f"{strategy} compiled, float64")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ENGINES)
def test_eager_checkpointing_modes_pass_the_float64_harness(distributed, strategy):
    ref = train_reference("gpt", "adamw", steps=4)
    for mode in ("selective", "full"):
        if (strategy, "f64", f"eager-{mode}") in distributed:
            assert_parity(ref, distributed[(strategy, "f64", f"eager-{mode}")], f"{strategy} {mode} checkpointing")


@pytest.mark.slow
def test_compiled_checkpointing_accumulation_and_frozen_units_match_single(distributed):
    ref = train_reference("gpt", "adamw", steps=4)
    for s, mode in (("zero3", "selective"), ("fsdp", "selective"), ("torch-fsdp", "selective"), ("ddp", "full")):
        assert_parity(ref, distributed[(s, "f64", mode)], f"{s} compiled + {mode} checkpointing")
    sgd_ref = train_reference("gpt", "sgd", steps=4)
    frozen_ref = train_reference("gpt_frozen", "adamw", steps=4)
    for s in ("zero3", "fsdp"):
        assert_parity(sgd_ref, distributed[(s, "f64", "accumulate")], f"{s} compiled, accumulation 2")
        assert_parity(frozen_ref, distributed[(s, "f64", "frozen")], f"{s} compiled, frozen halves + selective")


@pytest.mark.slow
def test_compiled_mixed_precision_matches_eager(distributed):
    eager, compiled = distributed[("fsdp", "bf16", "eager")], distributed[("fsdp", "bf16", "compiled")]
    # bf16 compute: the two orders of rounding differ by bf16's resolution (2^-8 relative) per op;
    # measured 3.2e-4 relative on the losses here. A 2x gradient changes the third step's loss by ~2 %.
    _assert_close_losses(compiled[0], eager[0], 3e-3, "fsdp bf16 compiled")


# -- single, in this process ---------------------------------------------------------------------
@pytest.mark.slow
def test_single_compiled_and_checkpointed_matches_eager():
    eager = train_engine(0, 1, "gpt", "single", "adamw", steps=4, dtype=F32)
    for mode in ("none", "selective", "full"):
        got = train_engine(0, 1, "gpt", "single", "adamw", steps=4, dtype=F32, compile=True,
                           activation_checkpointing=mode)
        _assert_close_losses(got[0], eager[0], COMPILED_VS_EAGER_LOSS_RTOL, f"single compiled + {mode}")
        assert_parity(eager, got, f"single compiled + {mode}", **FLOAT32_TOL["adamw"])
        assert list(got[1]) == list(eager[1])  # the same names, in order: no _orig_mod.


def _saved_bytes(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward after one forward of `block`,
    its parameters excepted: the activations it keeps (eager, or the compiled graph's). An eager
    checkpoint keeps its own saved tensors out of these hooks' sight (only its input shows)."""
    storages: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    out.sum().backward()
    return sum(storages.values())


@pytest.mark.slow
def test_compiled_checkpointing_saves_less_for_backward():
    """Inside the compiled graph the partitioner honours the checkpoint: full keeps about the
    block's input (plus parameters), selective the matmul and attention outputs, none everything.
    (Eager selective keeps its matmul outputs in its own cache, out of the hooks' sight: the
    memory tracker measures eager runs, test_checkpointing_modes_order_peak_memory.)"""
    saved = {}
    for mode in ("none", "selective", "full"):
        model = build("gpt", "cpu", F32)
        apply_to_units(list(model.blocks), Checkpointing(mode), compile=True)
        x = torch.randn(12, 16, 36, requires_grad=True)  # gpt's activations at N=1: the graphs compiled above
        _saved_bytes(model.blocks[0], x)  # compiles forward and backward
        saved[mode] = _saved_bytes(model.blocks[0], x)
    assert saved["full"] < saved["selective"] < saved["none"], saved


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the Linear products (mm, addmm) that run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def test_selective_recomputes_every_other_linear_product():
    """Selective keeps the 1st and 3rd of a unit's four Linear products and recomputes the 2nd and
    4th in backward (torchtitan's op policy, [Note: what selective checkpointing saves]): backward
    runs 2 products more than with nothing checkpointed, full 4 more (the whole forward), and the
    gradients are the same. With biases (addmm) and without (mm), and counted afresh per call: a
    second forward before backward (two calls of one unit) recomputes the same two."""
    for bias in (False, True):
        torch.manual_seed(0)
        widths = (8, 12, 10, 14, 6)  # distinct widths: any mix-up of saved outputs fails loudly
        unit = torch.nn.Sequential(*[m for a, b in zip(widths, widths[1:])
                                     for m in (torch.nn.Linear(a, b, bias=bias), torch.nn.Tanh())])
        x = torch.randn(5, 8)
        mm_in_backward, grads = {}, {}
        for mode in ("none", "selective", "full"):
            unit.zero_grad(set_to_none=True)
            apply_to_units([unit], Checkpointing(mode), compile=False)
            loss = unit(x).square().sum() + unit(2 * x).sum()  # two calls before one backward
            with _CountMatmuls() as counted:
                loss.backward()
            mm_in_backward[mode] = counted.count
            grads[mode] = [p.grad.clone() for p in unit.parameters()]
            unit.__dict__.pop("forward", None)  # back to the class's forward for the next mode
        assert mm_in_backward["selective"] - mm_in_backward["none"] == 2 * 2, (bias, mm_in_backward)
        assert mm_in_backward["full"] - mm_in_backward["none"] == 2 * 4, (bias, mm_in_backward)
        for mode in ("selective", "full"):
            for g, ref in zip(grads[mode], grads["none"]):
                torch.testing.assert_close(g, ref, rtol=0, atol=0)


# -- the training loop: compile time reported, checkpoint/resume, export, checkpointing memory ---
def _loop_runs(rank: int, world: int, out: str) -> dict:
    from shardlab.loop import train as T
    from tests.checkpoint_helpers import make_cfg, runtime, straight_and_resumed

    result = {}
    no_dropout = ("model.dropout=0.0", "train.memory_tracking=last")
    for name, extra in (("compiled", ("train.compile=true",)), ("eager", ()),
                        ("ac-selective", ("train.activation_checkpointing=selective",)),
                        ("ac-full", ("train.activation_checkpointing=full",)),
                        ("ac-full-every2", ("train.activation_checkpointing=full", "train.ac_every=2"))):
        cfg = make_cfg("fsdp", out, name, *no_dropout, *extra, "model.n_layer=4", "checkpoint.every_steps=0",
                       "checkpoint.final=false", steps=3)
        m = T.train(cfg, runtime(rank, world, "fsdp"))
        result[name] = {k: m[k] for k in ("losses", "compile_s", "compiled_graphs", "peak_live_bytes", "step_times_s",
                                          "samples_per_s", "throughput_steps", "mfu_note")}
        result[name]["activation_checkpointing"] = cfg.train.activation_checkpointing
    # eager's config is that of checkpointing none (the key's default): one run serves both
    result["ac-none"] = result["eager"]
    # dropout on (its masks and the RNG state must resume too), the checkpoint saved and loaded
    # through the compiled model, the export at the end
    result["resume"] = straight_and_resumed(rank, world, "fsdp", out, "train.compile=true",
                                            "train.activation_checkpointing=selective", "export.format=hf",
                                            tag="-compiled")
    return result


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("compile-loop"))
    return run_workers(2, _loop_runs, out, timeout_s=600)[0], out


@pytest.mark.slow
def test_compile_time_is_reported_once_and_the_math_is_eager_s(loop):
    runs, _ = loop
    compiled, eager = runs["compiled"], runs["eager"]
    assert compiled["compile_s"] > 0 and compiled["compiled_graphs"] >= 1  # the first run of its process
    assert compiled["peak_live_bytes"] is None  # the tracker is off with compile (docs/memory.md)
    assert eager["compile_s"] is None and eager["compiled_graphs"] is None
    # throughput leaves out the step that compiled (make_cfg's global batch: 12); eager's counts every step
    assert compiled["throughput_steps"] == 2 and eager["throughput_steps"] == 3
    assert compiled["samples_per_s"] == pytest.approx(2 * 12 / sum(compiled["step_times_s"][1:]))
    assert eager["samples_per_s"] == pytest.approx(3 * 12 / sum(eager["step_times_s"]))
    assert "train.compile" in compiled["mfu_note"]  # the summary's MFU row says why there is no figure
    _assert_close_losses(compiled["losses"], eager["losses"], COMPILED_VS_EAGER_LOSS_RTOL, "train.compile=true")


@pytest.mark.slow
def test_compiled_run_resumes_exactly_and_leaks_no_wrapper_names(loop):
    runs, out = loop
    r = runs["resume"]
    assert r["resumed"] == r["straight"] and r["steps_this_run"] < len(r["straight"])
    from safetensors import safe_open

    from shardlab.checkpoint import list_checkpoints, read_tensors

    run = os.path.join(out, "fsdp-compiled-straight")
    (_, path), *_ = list_checkpoints(os.path.join(run, "checkpoints"))
    keys = list(read_tensors(path, "model/"))
    with safe_open(os.path.join(run, "hf", "model.safetensors"), "pt") as f:
        exported = list(f.keys())
    assert keys and exported
    assert not [k for k in keys + exported if "_orig_mod" in k]
    with torch.device("meta"):  # the names of the model itself, as saved by an eager run
        names = {"model/" + k for k in GPT(GPT_PRESETS["gpt-nano"]).state_dict()}
    assert set(keys) <= names and {k for k in names if ".blocks." in k or "blocks." in k} <= set(keys)


@pytest.mark.slow
def test_checkpointing_modes_order_peak_memory(loop):
    """Live tensor bytes at the step's peak (the tracker, eager): every checkpointing mode keeps
    less than none, selective keeps more than full, and full on every second block sits between;
    the losses stay those of none (recomputation repeats the same arithmetic)."""
    runs, _ = loop
    assert runs["ac-none"]["activation_checkpointing"] == "none"
    peak = {k: max(runs[f"ac-{k}"]["peak_live_bytes"]) for k in ("none", "selective", "full", "full-every2")}
    assert peak["full"] < peak["selective"] < peak["none"], peak
    assert peak["full"] < peak["full-every2"] < peak["none"], peak
    for k in ("selective", "full", "full-every2"):
        assert runs[f"ac-{k}"]["losses"] == runs["ac-none"]["losses"], k


def test_compiled_summary_leaves_compilation_out_of_throughput(capsys):
    """The summary of a compiled run (the issue's: 88 s compiling, then 0.7 s steps): samples/s and
    tokens/s from the steps after the first, the compile seconds on their own row, the MFU row
    with its reason. No process: `throughput` and the table on a made-up run."""
    from types import SimpleNamespace

    from shardlab.loop.run_summary import print_summary, throughput

    train = SimpleNamespace(compile=True, global_batch_size=16)
    run = SimpleNamespace(state=SimpleNamespace(step=4), cfg=SimpleNamespace(train=train),
                          data=SimpleNamespace(real_tokens=None, tokens_per_sample=128))
    rates = throughput(run, [88.0, 0.7, 0.7, 0.7])
    assert rates["samples_per_s"] == pytest.approx(3 * 16 / 2.1) and rates["throughput_steps"] == 3
    assert rates["tokens_per_s"] == pytest.approx(3 * 16 * 128 / 2.1) and rates["samples_processed"] == 64
    train.compile = False
    assert throughput(run, [88.0, 0.7, 0.7, 0.7])["samples_per_s"] == pytest.approx(64 / 90.1)
    result = {**rates, "strategy": "fsdp", "world_size": 2, "device": "cpu", "steps": 4, "final_loss": 5.0,
              "steps_this_run": 4, "step_time_median_s": 0.7, "mfu": None, "compile_s": 88.0, "compiled_graphs": 3,
              "mfu_note": "not counted under train.compile: compiled kernels bypass the dispatcher that counts FLOPs",
              "num_parameters": 1e6, "num_trainable_parameters": 1e6, "model_state_bytes": [2**20],
              "peak_memory_bytes": [2**30], "wall_clock_s": 95.0, "step_times_s": [88.0, 0.7, 0.7, 0.7]}
    print_summary(result, "runs/x")
    text = capsys.readouterr().out
    assert "22.9 (steps 2-4)" in text and "2926 (steps 2-4)" in text and "88.0 s, 3 graphs; step 1: 88.0 s" in text
    assert "not counted under train.compile" in text and "MFU" in text


# -- configuration ------------------------------------------------------------------------------
def test_activation_checkpointing_keys():
    from shardlab.config import ConfigError, load_config

    for old, new in ((True, "full"), (False, "none")):
        with pytest.warns(FutureWarning, match=f"train.activation_checkpointing={str(old).lower()} is deprecated"):
            cfg = load_config(None, [f"train.activation_checkpointing={str(old).lower()}"])
        assert cfg.train.activation_checkpointing == new
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(None, ["train.activation_checkpointing=selective", "train.ac_every=2", "train.compile=true",
                                 "train.compile_mode=max-autotune-no-cudagraphs"])
    assert (cfg.train.activation_checkpointing, cfg.train.ac_every, cfg.train.compile) == ("selective", 2, True)
    for bad, words in (("train.activation_checkpointing=some", "none, full, selective"),
                       ("train.ac_every=0", "train.ac_every"), ("train.compile=maybe", "train.compile"),
                       ("train.compile_mode=fast", "reduce-overhead")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, [bad, "train.compile=true"] if "mode" in bad else [bad])
    with pytest.raises(ConfigError, match="train.compile=true"):
        load_config(None, ["train.compile_mode=default"])


def test_policy_and_units():
    assert Checkpointing.parse(True) == Checkpointing("full") and Checkpointing.parse(False).mode == "none"
    assert [Checkpointing("full", every=2).applies_to(i) for i in range(4)] == [True, False, True, False]
    with pytest.raises(ValueError, match="none, full, selective"):
        Checkpointing("partial")
    model = build("gpt", "cpu", F32)
    apply_to_units(list(model.blocks), Checkpointing("selective", every=2), compile=False)
    assert "forward" in model.blocks[0].__dict__ and "forward" not in model.blocks[1].__dict__
    with pytest.raises(ValueError, match="applied to it before"):
        apply_to_units(list(model.blocks), Checkpointing("full"), compile=False)
    x, y = batch("gpt", 0, F32)
    set_mode(model, "gpt")
    assert torch.isfinite(model(x, y))


# -- shardlab plan follows the checkpointing mode --------------------------------------------------
_PLAN_KEYS = ["model.preset=gpt-tiny", "data.source=synthetic", "data.seq_len=64", "train.micro_batch_size=4",
              "train.global_batch_size=8", "parallel.strategy=fsdp"]


def _probe_each_mode(modes: tuple[str, ...]) -> dict:
    """In a spawned child (plan's probes run on a fake process group of their own): fsdp's probe at
    N=2, 2 blocks, once per checkpointing mode, with train.compile on (the probe runs eagerly)."""
    from shardlab.config import load_config
    from shardlab.plan.probe import probe_child

    def plan(m: str) -> dict:  # on fake tensors, as plan probes (plan/probe.py)
        raw = load_config(None, [*_PLAN_KEYS, f"train.activation_checkpointing={m}", "train.compile=true"]).to_dict()
        return {"fsdp": {"raw": raw, "fake": True, "micro": 4, "seq": 64}}

    return {m: probe_child(plan(m), 2, [2], 1)["fsdp"]["2"] for m in modes}


@pytest.mark.slow
def test_plan_follows_the_checkpointing_mode():
    from shardlab.config import load_config
    from shardlab.plan import GPUS, INTERCONNECTS, step_time, verdict
    from shardlab.plan.model import in_child
    from shardlab.plan.predict import Prediction
    from shardlab.plan.probe import probe_config, probe_layers

    def cfg(*extra: str):
        return load_config(None, [*_PLAN_KEYS, *extra])

    # the probe keeps the mode and every K-th block, and runs eagerly (the tracker cannot see compiled code)
    probe = probe_config(cfg("train.activation_checkpointing=selective", "train.ac_every=2", "train.compile=true",
                             "train.compile_mode=default"), 3, 4, 64, 2, 3, 1, "/nonexistent")
    assert (probe.train.activation_checkpointing, probe.train.ac_every, probe.train.compile,
            probe.train.compile_mode) == ("selective", 2, False, None)
    assert probe_layers(cfg().train, 12) == [3, 4] and probe_layers(cfg("train.ac_every=2").train, 12) == [3, 4]
    assert probe_layers(cfg("train.activation_checkpointing=full", "train.ac_every=3").train, 12) == [3, 6]
    assert probe_layers(cfg("train.activation_checkpointing=full", "train.ac_every=3").train, 4) == [3, 4]
    # compute without a probe's counted FLOPs: full recomputes the forward (6 -> 8 FLOPs per parameter and
    # token), selective every other Linear product (about 0.4 of the forward: 6 -> 6.8)
    gpu, link = GPUS["H100"], INTERCONNECTS["loopback"]
    compute = [step_time(cfg(f"train.activation_checkpointing={m}", *e), "fsdp", 2, link, gpu, None)["compute_s"]
               for m, e in (("none", ()), ("selective", ()), ("full", ()), ("full", ("train.ac_every=2",)))]
    assert compute == pytest.approx([compute[0] * r for r in (1, 6.8 / 6, 8 / 6, 7 / 6)])  # gpt-tiny: 4 blocks
    # the verdict suggests checkpointing when activations dominate, unless it is full already
    big = Prediction("fsdp", 2, 100 << 30, {"params": 0, "grads": 0, "optimizer": 0, "activations": 90 << 30},
                     "backward", {})
    for mode, suggested in (("none", "=full"), ("selective", "=full"), ("full", None)):
        changes = " ".join(verdict(cfg(f"train.activation_checkpointing={mode}"), big, gpu, {}, 2)["changes"])
        assert (f"train.activation_checkpointing{suggested}" in changes) if suggested else \
            "activation_checkpointing" not in changes, (mode, changes)
    # the probe itself: the forward's saved activations fall from none to selective to full
    probes = in_child(_probe_each_mode, ("none", "selective", "full"), timeout_s=240)
    act = {m: p["fwd_parts"]["activations"] for m, p in probes.items()}
    assert act["full"] < act["selective"] < act["none"], act
    assert probes["full"]["peak"] <= probes["selective"]["peak"] <= probes["none"]["peak"], probes


# -- the GPU check explains itself on a machine without CUDA ------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: `make gpu-check` runs the real suite")
def test_gpu_check_skips_with_a_clear_message_without_cuda():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/gpu"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert "no CUDA device" in text and "make gpu-check" in text, text[-3000:]
    assert " passed" not in text and "skipped" in text


def test_bench_activation_checkpointing_and_compile_axes():
    import argparse

    from shardlab.bench import add_arguments, check_arguments
    from shardlab.bench_cells import cell_overrides, plan_cells

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--strategies", "ddp,fsdp", "--nproc", "2", "--activation-checkpointing", "none,selective",
                         "--compile", "false,true", "--preset", "gpt-nano"])
    strategies, worlds, variants = check_arguments(args)
    order, skipped = plan_cells(strategies, worlds, variants)
    assert not skipped and len(order) == 2 * 2 * 2  # every engine takes both axes
    overrides = cell_overrides(args, "fsdp", 2, {"activation_checkpointing": "selective", "compile": "true"})
    assert "train.activation_checkpointing=selective" in overrides and "train.compile=true" in overrides
    assert json.dumps(order)


def test_gpu_report_is_dated_written_whole_and_linked_once(tmp_path):
    from tests.gpu.report import LINKS_HEADING, Report, add_link

    (tmp_path / "benchmarks.md").write_text("# Benchmarks\n\nIntro.\n\n## 2026-11-22 — a table\n")
    docs = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"  # the real page: its placeholder goes
    assert "(none yet)" not in add_link(docs.read_text(), "- a link", "x.md").split(LINKS_HEADING)[1].split("##")[0]
    report = Report("NVIDIA H100 80GB HBM3", ["torch 2.13"], date="2026-11-23")
    report.add("every engine on NCCL", ["| run | diff |"], True)
    report.add("offload", ["saved 10 MiB"], False)
    for _ in range(2):  # the same day again: one report, one link
        path = report.write(tmp_path)
    assert path == tmp_path / "gpu-check" / "2026-11-23-nvidia-h100-80gb-hbm3.md"
    text = path.read_text()
    assert text.startswith("# GPU check, 2026-11-23, NVIDIA H100 80GB HBM3") and "| offload | FAIL |" in text
    index = (tmp_path / "benchmarks.md").read_text()
    assert index.count("gpu-check/2026-11-23-nvidia-h100-80gb-hbm3.md)") == 1 and "(1 of 2 checks" in index
    assert index.index(LINKS_HEADING) < index.index("Intro.") and index.endswith("## 2026-11-22 — a table\n")
    assert not [p for p in tmp_path.rglob(".*tmp*")]


def saved_bytes_table(preset: str, micro: int, seq: int) -> None:
    """`python -m tests.test_compile PRESET MICRO SEQ`: the activations one block of a GPT preset
    keeps for backward, eager and compiled, per checkpointing mode (docs/benchmarks.md)."""
    torch.set_num_threads(1)
    for compiled in (False, True):
        for mode in ("none", "selective", "full"):
            model = GPT(GPT_PRESETS[preset])
            apply_to_units(list(model.blocks), Checkpointing(mode), compile=compiled)
            x = torch.randn(micro, seq, GPT_PRESETS[preset].n_embd, requires_grad=True)
            _saved_bytes(model.blocks[0], x)  # compiles forward and backward
            print(f"{preset} block, micro {micro} x {seq}, {'compiled' if compiled else 'eager'}, {mode}: "
                  f"{_saved_bytes(model.blocks[0], x) / 2**20:.2f} MiB kept for backward", flush=True)


if __name__ == "__main__":
    saved_bytes_table(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
