"""plan's clock (plan/clock.py, [Note: plan's clock]): each operation at the rate of its kind and dtype on
the GPU, without running a probe (cheap: the meta model and arithmetic only)."""

from __future__ import annotations

import os

import pytest

from shardlab.config import load_config
from shardlab.plan.catalogue import GPUS, INTERCONNECTS
from shardlab.plan.clock import compute_seconds, gpu_machine, operation_seconds
from shardlab.plan.traffic import step_time

GPT2_SMALL = "configs/gpt2-small.yaml"


def test_gpt2_small_on_a_t4_runs_at_the_dtypes_peak():
    """Issue 46: fp32 at the T4's fp32 peak (8.1 TFLOP/s, its data sheet cited), fp16 at its tensor cores (65)."""
    t4, link = GPUS["T4"], INTERCONNECTS["pcie-gen3"]
    assert "FP32 8.1 TFLOPS" in t4.source and t4.peak("fp32") == 8.1e12 and t4.peak("fp16") == 65e12
    fp32 = load_config(GPT2_SMALL, ["train.precision=fp32", "parallel.mixed_precision=fp32"])
    fp16 = load_config(GPT2_SMALL, ["train.precision=fp16", "parallel.mixed_precision=fp16"])
    flops = 1e15  # one rank's step, as a probe would count it
    at32 = step_time(fp32, "single", 1, link, t4, step_flops=flops)   # one rank: no collective to price
    at16 = step_time(fp16, "single", 1, link, t4, step_flops=flops)
    assert at32["compute_s"] == pytest.approx(flops / 8.1e12)
    assert at16["compute_s"] == pytest.approx(flops / 65e12)
    # and without a probe's count (6 x parameters x tokens): the achieved FLOP/s never pass the dtype's peak
    no_probe = step_time(fp32, "single", 1, link, t4)
    assert no_probe["flops_per_token"] * 64 * 1024 / no_probe["compute_s"] == pytest.approx(8.1e12)


def test_each_kind_of_operation_has_its_own_rate():
    """A census (plan/ops.py records) priced on an H100: a square bf16 matmul at the measured ceiling (MAMF),
    a skinny one by its bytes, attention at FlashAttention-2's share, an elementwise kernel at bandwidth,
    every operator's dispatch on the host, overlapped with the device."""
    h100 = gpu_machine(GPUS["H100"])
    n = 8192
    square = ("matmul", "mm", "bf16", ((n, n), (n, n)), 2 * n**3, 3 * n * n * 2)
    skinny = ("matmul", "mm", "bf16", ((1, n), (n, n)), 2 * n * n, (n * n + 2 * n) * 2)
    attention = ("attention", "_scaled_dot_product_flash_attention", "bf16", (), 1e12, 1e6)
    add = ("memory", "", "bf16", (), 0, 3e9)
    view = ("view", "", "bf16", (), 0, 0)
    parts = operation_seconds({square: 1, skinny: 1, attention: 1, add: 1, view: 1000}, h100)
    assert parts["matmul"] == pytest.approx(2 * n**3 / 794.5e12 + (n * n + 2 * n) * 2 / 3.35e12)
    assert parts["attention"] == pytest.approx(1e12 / (989e12 * 0.35))  # FA-2's share of the data sheet's peak
    assert parts["memory"] == pytest.approx(3e9 / 3.35e12)
    assert parts["host"] == pytest.approx(1004 * 5e-6)
    assert compute_seconds(parts, h100) == pytest.approx(parts["matmul"] + parts["attention"] + parts["memory"])
    # torchtitan's H100 (96 GB HBM2e, 2.4 TB/s, 500 W): the same kernels, its own bandwidth
    grand_teton = operation_seconds({square: 1, attention: 1, add: 1}, gpu_machine(GPUS["H100-96"]))
    assert grand_teton["memory"] == pytest.approx(3e9 / 2.4e12) and grand_teton["attention"] == parts["attention"]
    # fp32 on an A100 runs on its CUDA cores (19.5), not tf32 or the tensor cores
    a100 = gpu_machine(GPUS["A100-80"])
    fp32 = ("matmul", "mm", "fp32", ((n, n), (n, n)), 2 * n**3, 3 * n * n * 4)
    assert operation_seconds({fp32: 1}, a100)["matmul"] == pytest.approx(2 * n**3 / 19.5e12)


def test_no_fixed_mfu_remains_in_plan():
    import shardlab.plan as plan
    import shardlab.plan.catalogue as catalogue

    assert not hasattr(catalogue, "MFU") and "MFU" not in plan.__all__


def test_the_census_sees_each_kind_of_operation():
    """plan/ops.py on a real step of a tiny model: matmul FLOPs as `CountFlops` counts them, the optimizer's
    kernels told apart by its step hooks, views and queries moving no bytes, a lookup reading only its rows;
    and --gpu cpu's rates (plan/cpu.py) time a matmul shape of it."""
    import torch

    from shardlab.plan.cpu import cpu_machine
    from shardlab.plan.ops import OpCensus, totals

    torch.manual_seed(0)
    table, linear = torch.nn.Embedding(1000, 16), torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW([*table.parameters(), *linear.parameters()])
    ids = torch.tensor([[1, 2, 3, 4]])
    with OpCensus() as census:
        hidden = table(ids)
        linear(hidden.view(4, 16)).sum().backward()
        opt.step()
    kinds = totals(census.census)
    assert kinds["matmul"]["flops"] == census.flops > 0
    assert kinds["optimizer"]["calls"] > 0 and kinds["optimizer"]["bytes"] >= 2 * 4 * (1000 * 16 + 16 * 16 + 16)
    assert kinds["view"]["calls"] > 0 and kinds["view"]["bytes"] == 0
    lookups = [(key, n) for key, n in census.census.items() if key[0] == "memory" and key[5] == 2 * 4 * 16 * 4]
    assert lookups, "the embedding's forward reads its 4 rows (2 x 4 x 16 floats), not the 1000-row table"
    machine = cpu_machine(1)
    parts = operation_seconds(census.census, machine)
    assert all(v >= 0 for v in parts.values()) and parts["matmul"] > 0 and parts["host"] > 0
    # a memory-bound kernel is recorded with its arguments, and --gpu cpu replays it at them (a CPU's
    # GELU or layer norm is bound by arithmetic, not bytes): its rate is measured, in bytes/s
    lookup = next(key for key, _ in lookups)
    assert lookup[1] == "aten.embedding.default" and lookup[3][0][0] == ("T", (1000, 16), "fp32")
    assert machine.rate(*lookup[:4], lookup[5]) > 0


def test_cpu_host_work_is_measured_on_the_engines_own_step():
    """--gpu cpu's narrow step (plan/cpu.py, [Note: the host's work, measured]): at one rank the engine's own
    step at a negligible width in CPU seconds; beyond one its step at the real width and a few tokens on a
    real gloo group of the world's size, in wall seconds less its own arithmetic, with every collective whole
    inside (so the link prices none) and the share of the cores the ranks kept busy; a model it cannot narrow
    falls back to one operator's dispatch per operator (None)."""
    from shardlab.plan.cpu import cpu_machine

    cfg = load_config("configs/gpt-tiny.yaml", ["model.preset=gpt-nano", "data.seq_len=32"])
    for world in (1, 2):
        narrow = cpu_machine(world).host_step
        step = narrow(cfg, "fsdp")
        assert 0 < step.seconds < 5.0 and 0 < step.busy <= 1.0 and narrow.cache == {"fsdp": step}, world
        assert step.collectives == (world > 1), world
        if world * int(os.environ.get("OMP_NUM_THREADS") or 1) <= (os.cpu_count() or 1):
            assert step.busy == 1.0, "each rank has a core of its own: nothing stretches its arithmetic"
    cfg.model.name = "resnet"
    assert cpu_machine(2).host_step(cfg, "ddp") is None


def test_a_narrow_step_on_a_real_group_holds_the_collectives_and_stretches_the_arithmetic():
    """Where the narrow step holds the collectives (`NarrowStep.collectives`), the link prices none of them;
    where the ranks share cores, each kind of arithmetic takes 1 / busy as long ([Note: ranks sharing cores]
    in plan/cpu.py); the step is the narrow step's seconds plus the stretched arithmetic."""
    from shardlab.plan.clock import Machine, NarrowStep
    from shardlab.plan.ops import Census

    cfg = load_config("configs/gpt-tiny.yaml")
    census: Census = {("matmul", "mm", "fp32", ((64, 64), (64, 64)), 2 * 64**3, 3 * 64 * 64 * 4): 10.0,
                      ("memory", "aten.gelu.default", "fp32", (), 0, 2 * 64 * 64 * 4): 10.0}

    def cpu(narrow: NarrowStep | None) -> Machine:
        return Machine("cpu", {"fp32": 1e11}, 1e10, 1e-6, 1.0, False, slowdown=2.0,
                       host_step=lambda c, e: narrow)

    link = INTERCONNECTS["loopback"]
    alone = step_time(cfg, "zero3", 4, link, None, census=census, machine=cpu(None))
    whole = step_time(cfg, "zero3", 4, link, None, census=census, machine=cpu(NarrowStep(0.05, 0.5, True)))
    assert alone["comm_s"] > 0 and whole["comm_s"] == 0.0
    assert whole["comm_in_host"] and not alone["comm_in_host"], "the report must say where the collectives went"
    for kind in ("matmul", "memory"):
        assert whole["parts_s"][kind] == pytest.approx(2 * alone["parts_s"][kind], rel=1e-12)
    assert whole["step_s"] == pytest.approx(0.05 + whole["parts_s"]["matmul"] + whole["parts_s"]["memory"], rel=1e-12)


def test_replayed_kernels_get_operands_in_every_functions_domain():
    """--gpu cpu replays each memory-bound kernel at its arguments (plan/cpu.py, `_build`): floats drawn from
    [0.5, 1.5), where a step's values are when the domain matters (Adam's sqrt reads a second moment, never
    negative). Normal draws sent half of a sqrt's inputs down its NaN path, 18 times slower on this VM."""
    import torch

    from shardlab.plan.cpu import _build

    x = _build(("T", (4096,), "fp32"))
    assert x.dtype == torch.float32 and x.shape == (4096,) and 0.5 <= x.min() and x.max() < 1.5
    for fn in (torch.sqrt, torch.rsqrt, torch.log, torch.reciprocal):
        assert torch.isfinite(fn(x)).all(), fn
    assert _build(("T", (3,), "bf16")).dtype == torch.bfloat16
    assert (_build(("T", (3,), "int64")) == 0).all()  # indices: valid for any table


def test_replayed_kernels_write_their_outputs_to_memory_they_did_not_just_free(monkeypatch):
    """A memory-bound kernel's replay (plan/cpu.py, `_Rates._kernel`) keeps its outputs alive across its cycle of
    operand copies: each call writes where a step's output lands, memory last touched long before, not the block
    the allocator hands straight back (GELU inside gpt-tiny's step ran as the kept-output replay, 1.2-1.5 times
    the reused one)."""
    import weakref

    import torch

    from shardlab.plan import cpu

    outputs: list[weakref.ref] = []

    @torch.library.custom_op("shardlab_test::doubled", mutates_args=(), schema="(Tensor x) -> Tensor")
    def doubled(x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        outputs.append(weakref.ref(out))
        return out

    alive_after_calls = []

    def ten_calls(fn, *_):
        for _ in range(10):
            fn()
        alive_after_calls.append(sum(ref() is not None for ref in outputs))
        return 1.0

    monkeypatch.setattr(cpu, "_mean_call", ten_calls)
    spec = ((("T", (4096,), "fp32"),), ())
    assert cpu._Rates(1)._kernel("shardlab_test.doubled.default", spec, 2 * 4096 * 4) == 2 * 4096 * 4
    assert len(outputs) == 10 and alive_after_calls == [10]   # 64 copies of 32 KiB cycled: every output kept


def test_more_ranks_than_cores_stretch_the_collectives_bytes_on_a_cpu():
    """On a CPU the collectives' bytes are copied by the ranks' own cores; the loopback link was fitted with a
    core per rank, so with more ranks than cores the clock stretches its time as it stretches the arithmetic
    (`Machine.slowdown`); a GPU's collectives (slowdown 1) are not stretched."""
    from shardlab.plan.clock import Machine

    cfg = load_config("configs/gpt-tiny.yaml")
    link = INTERCONNECTS["loopback"]

    def cpu(slowdown: float) -> Machine:
        return Machine("cpu", {"fp32": 1e11}, 1e10, 1e-6, 1.0, False, slowdown=slowdown)

    own_core, shared = (step_time(cfg, "zero3", 4, link, None, step_flops=1e9, machine=cpu(s)) for s in (1.0, 2.0))
    assert own_core["comm_s"] > 0 and shared["comm_s"] == pytest.approx(2 * own_core["comm_s"], rel=1e-12)
    assert shared["step_s"] == pytest.approx(shared["compute_s"] + shared["comm_s"], rel=1e-12)
    assert gpu_machine(GPUS["H100"]).slowdown == 1.0


def test_only_engines_whose_ranks_meet_between_blocks_stretch_by_the_idle_cores():
    """[Note: ranks sharing cores]: the engines that gather parameters unit by unit meet before every unit's
    forward and backward, so their arithmetic stretches by the narrow step's idle cores; data-parallel ones
    meet once after it (the design's own collectives, `Plannable.step_traffic`)."""
    from shardlab.plan.cpu import _meets_between_blocks

    cfg = load_config("configs/gpt-tiny.yaml")
    assert {e: _meets_between_blocks(cfg, e, 4) for e in ("ddp", "torch-ddp", "zero3", "fsdp", "torch-fsdp")} == {
        "ddp": False, "torch-ddp": False, "zero3": True, "fsdp": True, "torch-fsdp": True}
