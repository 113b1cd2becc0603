"""Shared parity machinery: train a small model with an engine on N ranks and with `single`
on the same global batch, and compare per-step losses and final full parameters.

Cases (chosen to break engines in the known ways):
- gpt: tied embedding/head, odd sizes (vocab 97, width 36, 3 heads), so nothing divides N;
  no biases: the attention key bias has an exactly-zero true gradient (softmax is
  shift-invariant), which Adam would turn from float noise into lr-sized steps;
- mlp: Linear(7,15), Linear(15,3): some ranks hold empty shards at N=3,4;
- resnet: convolutions, BatchNorm buffers. BatchNorm runs in eval mode (running statistics
  fixed): in train mode each rank normalizes by its own micro batch's statistics, which is
  what PyTorch's DDP does too and differs from one process by design.
- frozen (FROZEN_CASES, not in CASES): half of each block frozen, LoRA style (see HalfFrozen).
Optimizers: plain SGD (a gradient off by N shows up at once) and AdamW.
The global batch (12) divides 1, 2, 3 and 4, and rank r takes rows [r*b, (r+1)*b).

[Note: why the harness runs in float64]
Engines sum gradients in another order than one process does (per rank, then across ranks),
so results differ by rounding. In float32 that noise (~1e-7 relative) is amplified by Adam
on near-zero gradients to ~1e-5 after three steps, which is where the float32 tolerances had
to sit: a test that passed or failed by CPU model, and a real bug of that size would hide
in it. In float64 (models, data and the reference alike; gloo reduces float64) the same
noise is ~1e-16 relative, so the tolerances below are tight and still many orders of
magnitude above it, while any real error (a gradient off by N, a missed update, a stale
parameter) is many orders of magnitude above them. Even AdamW, nearly blind to a gradient
scaled by N (only eps and weight decay see the scale), then moves parameters by >= 8.5e-7:
plain to see in float64, lost in float32's noise.
Measured (2-core AMD EPYC VM, torch 2.13 CPU, 2026-11-22; every engine incl. torch-ddp and
torch-fsdp, every case incl. the frozen ones, SGD/AdamW, with and without clipping, N = 1..4):
max |diff| of final parameters 4.4e-14 (losses: 3.9e-16 relative), at most 4.2e-4 of the
tolerance below; a gradient off by 2x or 0.5x (loss scaled, the reference itself) exceeds
it by at least 8.1e3x (AdamW on `frozen`; SGD by at least 2e8x). So noise sits 3.4 orders of
magnitude below the tolerance and the weakest N-fold gradient error 3.9 orders above it. In float32 the
same runs differ by up to 9.1e-6 (AdamW) and 1.2e-7 (SGD). `python -m tests.parity`
prints these figures (measure_margins, at the end of this file).
A few float32 cases stay (FLOAT32_TOL) to check the engines in the dtype people train in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardlab
from shardlab.models import GPT, GPTConfig, MLPModel, ResNet
from shardlab.models.init import INIT_STD_ATTR, init_parameters_

GLOBAL_BATCH = 12
DTYPE = torch.float64  # the harness's default dtype, see [Note: why the harness runs in float64]

# float64 tolerances (losses: rtol only): |diff| <= 1e-10 + 1e-10 |ref|; the Note gives the
# measured noise (<= 4.2e-4 of this) and the smallest N-fold-gradient signal (>= 8.1e3x this).
F64_RTOL, F64_ATOL = 1e-10, 1e-10
# float32 cases, measured on the same machine and runs: max |diff| of final parameters
# SGD 1.2e-7, AdamW 9.1e-6 (Adam turns rounding on near-zero gradients into parts of an
# lr-sized step; gpt/AdamW with clipping reached 2.6e-5 here and 1.06e-5 on another CPU,
# failing the old 1e-5; no float32 case below clips).
# Tolerances ~10x above the worst seen: SGD 1e-5 (a 2x gradient moves SGD parameters by
# >= 2e-2 here), AdamW 1e-4 (gpt/AdamW's 2x signal is 6.7e-3; float32 cannot see Adam's
# smaller ones, which is why the harness runs in float64).
FLOAT32_TOL = {"sgd": {"rtol": 1e-5, "atol": 1e-5}, "adamw": {"rtol": 1e-4, "atol": 1e-4}}


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[str], nn.Module]          # device -> model (float32, as the model builds itself)
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # step -> global (inputs, targets)
    eval_bn: bool = False


def _gpt(device: str) -> nn.Module:
    with torch.device(device):
        return GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=3, n_embd=36, bias=False), seed=11)


def _gpt_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 97, (GLOBAL_BATCH, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _mlp(device: str) -> nn.Module:
    with torch.device(device):
        return MLPModel((7, 15, 3), seed=12)


def _mlp_batch(step: int):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def _resnet(device: str) -> nn.Module:
    with torch.device(device):
        return ResNet(blocks=(1, 1), width=4, num_classes=5, seed=13)


def _resnet_batch(step: int):
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)


# -- frozen and trainable parameters in one unit -------------------------------------------------
class LoRALinear(nn.Module):
    """A frozen Linear (weight, bias) with a trainable low-rank adapter in the same module, as
    peft lays out LoRA: any wrap unit holding one mixes frozen and trainable parameters."""

    def __init__(self, fin: int, fout: int, rank: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(fout, fin), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(fout), requires_grad=False)
        self.lora_A = nn.Parameter(torch.empty(rank, fin))
        self.lora_B = nn.Parameter(torch.empty(fout, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A), self.lora_B)


class _HalfFrozenBlock(nn.Module):
    """fc1 (frozen base + trainable adapter) -> LayerNorm (frozen) -> fc2 (trainable): in
    backward the frozen LayerNorm computes its input's gradient after fc2's weight gradient
    has arrived, the order that crashed zero3 when it freed the unit at that arrival."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = LoRALinear(width, hidden, 2)
        self.ln = nn.LayerNorm(hidden)
        self.ln.requires_grad_(False)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.ln(self.fc1(x))))


class HalfFrozen(nn.Module):
    """Every unit holds frozen and trainable parameters; so does the root (frozen input layer
    and final norm, trainable head). The first block's inputs need no gradient (the input
    layer is frozen), the others' do. Odd sizes: shards are uneven at N = 2, 3, 4."""

    def __init__(self, seed: int = 14, width: int = 10, hidden: int = 14, n_blocks: int = 3):
        super().__init__()
        self.init_seed = seed
        self.inp = nn.Linear(7, width)
        self.inp.requires_grad_(False)
        self.blocks = nn.ModuleList(_HalfFrozenBlock(width, hidden) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(width)
        self.ln_f.requires_grad_(False)
        self.head = nn.Linear(width, 3)
        for m in self.modules():  # healthy gradients: Adam's updates are then well conditioned
            setattr(m, INIT_STD_ATTR, 0.4)
        if self.head.weight.device.type != "meta":
            init_parameters_(self, seed)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out = self.head(self.ln_f(h))
        return out if targets is None else F.cross_entropy(out, targets)


def _half_frozen(device: str) -> nn.Module:
    with torch.device(device):
        return HalfFrozen()


def _half_frozen_gpt(device: str) -> nn.Module:
    """The gpt case with ln_1 and attention of every block frozen, the MLP half trainable."""
    model = _gpt(device)
    for block in model.blocks:
        block.ln_1.requires_grad_(False)
        block.attn.requires_grad_(False)
    return model


CASES: dict[str, Case] = {
    "gpt": Case("gpt", _gpt, _gpt_batch),
    "mlp": Case("mlp", _mlp, _mlp_batch),
    "resnet": Case("resnet", _resnet, _resnet_batch, eval_bn=True),
}
FROZEN_CASES: dict[str, Case] = {
    "frozen": Case("frozen", _half_frozen, _mlp_batch),
    "gpt_frozen": Case("gpt_frozen", _half_frozen_gpt, _gpt_batch),
}
ALL_CASES = {**CASES, **FROZEN_CASES}


def build(case_name: str, device: str, dtype: torch.dtype = DTYPE) -> nn.Module:
    """The case's model in `dtype` (on meta: shapes only; engines materialize it in that dtype).
    Initial values are drawn in float32 and widened exactly, so every dtype starts from the
    same numbers."""
    return ALL_CASES[case_name].build(device).to(dtype)


def batch(case_name: str, step: int, dtype: torch.dtype = DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = ALL_CASES[case_name].batch(step)
    return (x.to(dtype) if x.is_floating_point() else x), y


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """Over the trainable parameters only, as fine-tuning code does (frozen shards are
    parameters with requires_grad=False)."""
    params = [p for p in params if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


def _set_mode(model: nn.Module, case: Case) -> None:
    model.train()
    if case.eval_bn:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()


def set_mode(model: nn.Module, case_name: str) -> None:
    _set_mode(model, ALL_CASES[case_name])


def train_reference(case_name: str, opt_name: str, steps: int = 3, accumulate: int = 1,
                    clip: float | None = None, dtype: torch.dtype = DTYPE) -> tuple[list[float], dict]:
    """One process, the whole global batch per step. clip: max global grad norm (None = off)."""
    model = build(case_name, "cpu", dtype)
    set_mode(model, case_name)
    opt = make_optimizer(opt_name, model.parameters())
    losses = []
    for step in range(steps):
        x, y = batch(case_name, step, dtype)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_engine(rank: int, world: int, case_name: str, strategy: str, opt_name: str, steps: int = 3,
                 micro_batches: int = 1, meta: bool = True, clip: float | None = None, dtype: torch.dtype = DTYPE,
                 **options) -> tuple[list[float], dict]:
    """Each rank takes its slice of the global batch; with micro_batches=k the slice is split in
    k micro batches, the first k-1 backward passes inside no_sync (options: the engine's, e.g.
    accumulate="sharded"). Returns the global mean loss per step and the final full state dict."""
    model = shardlab.parallelize(build(case_name, "meta" if meta else "cpu", dtype), strategy, device="cpu",
                                 **options)
    set_mode(model, case_name)
    opt = make_optimizer(opt_name, model.parameters())
    b = GLOBAL_BATCH // world
    if b % micro_batches:
        raise ValueError(f"micro_batches={micro_batches} does not divide this rank's {b} samples: some would be dropped")
    losses = []
    for step in range(steps):
        x, y = batch(case_name, step, dtype)
        x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        mb = b // micro_batches
        for i in range(micro_batches):
            ctx = shardlab.no_sync(model) if i < micro_batches - 1 else _null()
            with ctx:
                loss = model(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) / micro_batches
                loss.backward()
            total += loss.detach().double()
        if clip is not None:
            shardlab.clip_grad_norm_(model, clip)
        opt.step()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, shardlab.full_state_dict(model)


def micro_batch_sgd(model: nn.Module, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]], steps: int,
                    micro: int, global_batch: int, rank: int = 0, world: int = 1) -> tuple[list[float], dict]:
    """SGD (lr 0.5, trainable parameters) over `steps` global batches (`batch(step)` -> inputs, targets):
    this rank takes its rows [rank b, (rank + 1) b) in micro batches of `micro`, each loss weighted 1/k,
    all but the last backward inside no_sync; the step's loss is the mean of every micro batch's mean
    loss over all ranks. world=1: one process with the whole batch, the reference (the same objective).
    Returns the losses and the final full state dict."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    b, losses = global_batch // world, []
    k = b // micro
    for step in range(steps):
        x, y = batch(step)
        x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        for m in range(k):
            with shardlab.no_sync(model) if world > 1 and m < k - 1 else _null():
                loss = model(x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]) / k
                loss.backward()
            total += loss.detach()
        opt.step()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    if world > 1:
        return losses, shardlab.full_state_dict(model)
    return losses, {name: v.detach().clone() for name, v in model.state_dict().items()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def tolerance(opt_name: str, dtype: torch.dtype = DTYPE) -> dict[str, float]:
    """assert_parity's rtol/atol for a run of this optimizer in this dtype."""
    if dtype == torch.float64:
        return {"rtol": F64_RTOL, "atol": F64_ATOL}
    return dict(FLOAT32_TOL[opt_name])


def parity_diff(ref: tuple[list[float], dict], got: tuple[list[float], dict]) -> dict[str, float]:
    """Max abs and rel differences of losses and floating parameters (to record margins)."""
    out = {"loss_abs": 0.0, "loss_rel": 0.0, "param_abs": 0.0, "param_rel": 0.0}
    for a, b in zip(ref[0], got[0]):
        out["loss_abs"] = max(out["loss_abs"], abs(a - b))
        out["loss_rel"] = max(out["loss_rel"], abs(a - b) / max(abs(a), 1e-300))
    for k, v in ref[1].items():
        if v.is_floating_point() and v.numel():
            d = (got[1][k].double() - v.double()).abs()
            out["param_abs"] = max(out["param_abs"], d.max().item())
            out["param_rel"] = max(out["param_rel"], (d / v.double().abs().clamp_min(1e-3)).max().item())
    return out


def assert_parity(ref: tuple[list[float], dict], got: tuple[list[float], dict], label: str,
                  rtol: float = F64_RTOL, atol: float = F64_ATOL) -> None:
    ref_losses, ref_state = ref
    losses, state = got
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64),
                               rtol=rtol, atol=0.0, msg=lambda m: f"{label}: per-step losses differ\n{m}")
    assert set(state) == set(ref_state), f"{label}: keys differ: {set(state) ^ set(ref_state)}"
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"{label}: parameter {k} differs\n{m}")


# -- measuring the margins (python -m tests.parity) -----------------------------------------------
MARGIN_ENGINES = ("ddp", "zero3", "fsdp", "torch-ddp", "torch-fsdp")


def _margin_runs(rank: int, world: int, engines: tuple[str, ...]) -> dict:
    out = {}
    for strategy in engines:
        for case in ALL_CASES:
            for opt in ("sgd", "adamw"):
                out[(strategy, case, opt, "f64")] = train_engine(rank, world, case, strategy, opt)
                out[(strategy, case, opt, "f64+clip")] = train_engine(rank, world, case, strategy, opt, clip=0.05)
                out[(strategy, case, opt, "f32")] = train_engine(rank, world, case, strategy, opt, dtype=torch.float32)
    return out


def _worst_ratio(ref: dict, got: dict, rtol: float, atol: float) -> float:
    """max over parameters of |diff| / (atol + rtol |ref|): below 1 passes assert_parity."""
    return max(((got[k].double() - v.double()).abs() / (atol + rtol * v.double().abs())).max().item()
               for k, v in ref.items() if v.is_floating_point())


def _scaled_reference(case_name: str, opt_name: str, scale: float) -> dict:
    """`single` with every gradient multiplied by `scale`: what an N-fold gradient bug looks like."""
    model = build(case_name, "cpu")
    set_mode(model, case_name)
    opt = make_optimizer(opt_name, model.parameters())
    for step in range(3):
        x, y = batch(case_name, step)
        opt.zero_grad(set_to_none=True)
        (model(x, y) * scale).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def measure_margins(worlds: tuple[int, ...] = (1, 2, 3, 4), engines: tuple[str, ...] = MARGIN_ENGINES) -> None:
    """Print the float64 noise (max diffs against `single` per engine, and as a fraction of the
    tolerance), the float32 diffs, and how far a gradient off by 2x or 0.5x lands above the
    tolerance. The figures in docs/engines.md ("Float64 parity") come from this."""
    from shardlab.testing import run_workers

    refs: dict = {}
    worst: dict = {}
    for world in worlds:
        got = run_workers(world, _margin_runs, engines, timeout_s=1800)[0]
        for (strategy, case, opt, kind), run in got.items():
            dtype = torch.float32 if kind == "f32" else torch.float64
            key = (case, opt, kind)
            if key not in refs:
                refs[key] = train_reference(case, opt, dtype=dtype, clip=0.05 if "clip" in kind else None)
            d = parity_diff(refs[key], run)
            row = worst.setdefault((strategy, kind.split("+")[0], opt), {"param_abs": 0.0, "loss_rel": 0.0, "ratio": 0.0})
            row["param_abs"] = max(row["param_abs"], d["param_abs"])
            row["loss_rel"] = max(row["loss_rel"], d["loss_rel"])
            if dtype == torch.float64:
                row["ratio"] = max(row["ratio"], _worst_ratio(refs[key][1], run[1], F64_RTOL, F64_ATOL))
    print(f"{'engine':12s} {'dtype':5s} {'opt':6s} {'max abs diff':>13s} {'max rel loss':>13s} {'diff/tol':>9s}")
    for (strategy, kind, opt), row in sorted(worst.items()):
        ratio = f"{row['ratio']:9.1e}" if kind == "f64" else f"{'-':>9s}"
        print(f"{strategy:12s} {kind:5s} {opt:6s} {row['param_abs']:13.1e} {row['loss_rel']:13.1e} {ratio}")
    signal = min((_worst_ratio(train_reference(case, opt)[1], _scaled_reference(case, opt, scale), F64_RTOL, F64_ATOL),
                  case, opt, scale) for case in ALL_CASES for opt in ("sgd", "adamw") for scale in (2.0, 0.5))
    print(f"weakest 2x/0.5x gradient error: {signal[0]:.1e} x the float64 tolerance ({signal[1]}, {signal[2]}, x{signal[3]})")


if __name__ == "__main__":  # python -m tests.parity [engine,engine,...]
    import sys

    measure_margins(engines=tuple(sys.argv[1].split(",")) if len(sys.argv) > 1 else MARGIN_ENGINES)
