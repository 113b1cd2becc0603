"""Comparing verify's runs: the error of every quantity, the tolerance, the first difference
and its likely cause.

[Note: what is compared, and how an error is measured]
Per step, in the order the step computes them (the first difference is the first one in
this order):
  forward   step 0, first micro batch: each module's output per sample (fingerprints,
            runs.fingerprint), in forward order; then the loss of every step
  backward  each parameter's full gradient before clipping, by original name, in the order
            of named_parameters; each rank's pieces are compared with the reference's same
            elements, so a rank that reduced differently is named even when rank 0 is right
  clip      the global gradient norm
  step      each parameter's value after the optimizer step
  buffers   every buffer after the step (BatchNorm's running statistics)
Every error is a relative one, measured so that rounding gives the same small number for
every kind of quantity:
  loss, gradient norm     |a - r| / |r|
  gradient                |a - r| / max(|r|, TAU * |G|)      (2-norms; G: all gradients)
  value after the step    (|a - r| - 2 (s+1) u |r|) / max(|r - r0|, TAU * |D|)  (r0: the initial
                          value; D: all parameters' distance from theirs; 2 (s+1) u |r|: what
                          storing a and r in their dtype rounds away by step s, u its unit roundoff)
  buffer                  |a - r| / |r|   (integer buffers: equal, or not)
  module output           per sample, each fingerprint entry's difference over |x| (its
                          Cauchy-Schwarz bound) or |x|^2 for the sum of squares
A value is measured against how far training moved it, not against its size: the updates are
what the steps compute, and a parameter's size says nothing about how well they agree (the
difference accumulates over the steps, as the distance does, so the ratio stays level). The floors (TAU of the
whole) keep a tensor whose true gradient or update is zero (a bias whose gradient cancels
mathematically; a frozen parameter) from turning rounding into a large relative error, while
a frozen parameter that moves at all still stands far above the tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from shardlab.verify import causes
from shardlab.verify.float64 import merge_float64
from shardlab.verify.runs import Plan, full_gradients, path_of
from shardlab.verify.tolerance import UNIT_ROUNDOFF, Tolerance, tolerance_for

TAU = 1e-2
PHASES = ("forward", "backward", "clip", "step", "buffers")


@dataclass(frozen=True)
class Finding:
    """The error of one compared quantity."""

    step: int
    phase: str                  # one of PHASES
    name: str                   # parameter, buffer or module path; "loss"; "gradient norm"
    error: float
    rank: int | None = None     # the rank whose piece differs most (gradients of the engine run)


@dataclass
class StepRow:
    step: int
    loss: float                 # the reference's
    loss_error: float
    grad_norm_error: float
    worst: Finding
    noise: float | None         # the noise run's largest error at this step (tensors); None: not run
    ok: bool                    # every quantity within the tolerance


@dataclass
class Report:
    title: str
    rows: list[StepRow]
    tolerance: Tolerance
    noise_floor: float | None   # None: not measured (--keep-dropout)
    first: Finding | None
    where: str = ""             # module path and type of the first difference
    cause: str | None = None
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def conclusive(self) -> bool:
        """The tolerance can tell a fault from rounding."""
        return self.tolerance.useful

    @property
    def equal(self) -> bool:
        return self.first is None and self.conclusive


# -- reading a run back ------------------------------------------------------------------------------
class Records:
    """One run's files (runs.record_run)."""

    def __init__(self, workdir: str, kind: str):
        self.workdir, self.kind = workdir, kind
        self.meta = self._load("meta.pt")
        self.world = self.meta["world"]
        acts = [self._load(f"acts.rank{r}.pt") for r in range(self.world)]
        self.order = acts[0]["order"]
        self.prints = {p: torch.cat([a["prints"][p] for a in acts]) for p in self.order
                       if all(p in a["prints"] for a in acts)}
        self.seconds = max(a["seconds"] for a in acts)
        self.dropout_disabled = acts[0]["dropout_disabled"]
        self.float64 = merge_float64([a.get("float64") for a in acts])

    def _load(self, name: str):
        return torch.load(path_of(self.workdir, self.kind, name), weights_only=False)

    def step(self, s: int) -> dict:
        return self._load(f"step{s}.pt")

    def pieces(self, s: int) -> list[dict[str, list[tuple[int, torch.Tensor]]]]:
        return [self._load(f"grads{s}.rank{r}.pt") for r in range(self.world)]


def islands_dtype(*runs: Records) -> torch.dtype | None:
    """The least precise dtype a float32 island of any run computed in (None: no island)."""
    names = {d for r in runs if r.float64 for d in r.float64["island_dtypes"]}
    dtypes = [getattr(torch, n) for n in names]
    return max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else None


# -- errors ------------------------------------------------------------------------------------------
def relative(a: torch.Tensor, r: torch.Tensor, scale: float) -> float:
    d = (a.to(torch.float64) - r.to(torch.float64)).norm().item()
    if d == 0.0:
        return 0.0
    return d / scale if scale > 0 else math.inf


def activation_error(a: torch.Tensor, r: torch.Tensor) -> float:
    """Fingerprints [rows, 3] (runs.fingerprint) -> the largest normalized difference."""
    size2 = r[:, 0].clamp_min(1e-300)
    size = size2.sqrt()
    d = (a - r).abs()
    return max((d[:, 0] / size2).max().item(), (d[:, 1:] / size[:, None]).max().item())


def _scalar_error(a: float, r: float) -> float:
    if a == r:
        return 0.0
    return abs(a - r) / abs(r) if r != 0 and math.isfinite(r) else math.inf


class StepComparison:
    """Every Finding of one run against the reference at one step, in the order of the Note."""

    def __init__(self, ref: Records, other: Records, s: int, ref_step: dict, ref_grads: dict[str, torch.Tensor]):
        self.findings: list[Finding] = []
        step = other.step(s)
        add = self.findings.append
        if s == 0:
            for path in ref.order:
                if path in ref.prints and path in other.prints and ref.prints[path].shape == other.prints[path].shape:
                    add(Finding(s, "forward", path, activation_error(other.prints[path], ref.prints[path])))
        add(Finding(s, "forward", "loss", _scalar_error(step["loss"], ref_step["loss"])))
        self._gradients(ref, other, s, ref_grads)
        add(Finding(s, "clip", "gradient norm", _scalar_error(step["grad_norm"], ref_step["grad_norm"])))
        self._values(ref, s, step["state"], ref_step["state"], ref.meta["initial"])

    def _gradients(self, ref: Records, other: Records, s: int, ref_grads: dict[str, torch.Tensor]) -> None:
        G = math.sqrt(sum(g.norm().item() ** 2 for g in ref_grads.values()))
        pieces = other.pieces(s)
        numel = {n: g.numel() for n, g in ref_grads.items()}
        numel.update({n: sum(v.numel() for _, v in items) for p in pieces for n, items in p.items() if n not in numel})
        whole = full_gradients(pieces, numel)
        for name in ref.meta["param_order"]:
            r, a = ref_grads.get(name), whole.get(name)
            if r is None and a is None:
                continue
            if r is None:  # no gradient in the reference (frozen or unused): anything non-zero differs
                err = math.inf if a.abs().max().item() > 0 else 0.0
                self.findings.append(Finding(s, "backward", name, err))
                continue
            a = a if a is not None else torch.zeros_like(r)
            scale = max(r.norm().item(), TAU * G)
            per_rank = [max((relative(v, r[o:o + v.numel()], scale) for o, v in p.get(name, ())), default=0.0)
                        for p in pieces]
            rank = max(range(len(per_rank)), key=per_rank.__getitem__)
            worst = max(relative(a, r, scale), per_rank[rank])
            self.findings.append(Finding(s, "backward", name, worst, rank if per_rank[rank] > 0 else None))

    def _values(self, ref: Records, s: int, state: dict, ref_state: dict, initial: dict) -> None:
        buffers = set(ref.meta["buffers"])
        params = [k for k in ref_state if k not in buffers]
        U = math.sqrt(sum((ref_state[k].double() - initial[k].double()).norm().item() ** 2
                          for k in params if ref_state[k].is_floating_point()))
        for k in params:
            r, a = ref_state[k], state[k]
            if not r.is_floating_point():
                self.findings.append(Finding(s, "step", k, 0.0 if torch.equal(a, r) else math.inf))
                continue
            moved = (r.double() - initial[k].double()).norm().item()
            scale = max(moved, TAU * U) or r.double().norm().item()
            # what storing the values rounds away (each of a, r once per step) is no difference
            stored = 2 * (s + 1) * UNIT_ROUNDOFF[r.dtype] * r.double().norm().item()
            d = (a.double() - r.double()).norm().item()
            self.findings.append(Finding(s, "step", k, max(0.0, d - stored) / scale if scale > 0 else
                                         (math.inf if d > stored else 0.0)))
        for k in ref_state:
            if k in buffers:
                r, a = ref_state[k], state[k]
                if r.is_floating_point():
                    err = relative(a, r, r.double().norm().item())
                else:
                    err = 0.0 if torch.equal(a, r) else math.inf
                self.findings.append(Finding(s, "buffers", k, err))

    def error_of(self, phase: str, name: str) -> float:
        return next((f.error for f in self.findings if f.phase == phase and f.name == name), 0.0)

    def worst(self) -> Finding:
        """The largest error among the tensors (loss and norm have columns of their own)."""
        tensors = [f for f in self.findings if f.name not in ("loss", "gradient norm")]
        return max(tensors, key=lambda f: f.error) if tensors else self.findings[0]

    def within(self, tol: Tolerance) -> bool:
        return all(f.error <= limit(f, tol) for f in self.findings)


# -- the whole comparison ----------------------------------------------------------------------------
def limit(f: Finding, tol: Tolerance) -> float:
    return tol.for_loss() if f.name == "loss" and f.phase == "forward" else tol.value


def compare(plan: Plan) -> Report:
    """Read the runs under plan.workdir back and compare engine and noise runs with the reference."""
    ref, engine = Records(plan.workdir, "reference"), Records(plan.workdir, "engine")
    noise = Records(plan.workdir, "noise") if "noise" in plan.references else None
    steps = []
    for s in range(plan.steps):
        ref_step = ref.step(s)
        numel = {k: v.numel() for k, v in ref_step["state"].items()}
        ref_grads = full_gradients(ref.pieces(s), numel)
        got = StepComparison(ref, engine, s, ref_step, ref_grads)
        floor = StepComparison(ref, noise, s, ref_step, ref_grads).worst().error if noise is not None else None
        steps.append((ref_step["loss"], got, floor))
    noise_floor = max(floor for _, _, floor in steps) if noise is not None else None
    tol = tolerance_for(plan, ref.meta, noise_floor, islands_dtype(ref, engine))
    rows = [StepRow(s, loss, got.error_of("forward", "loss"), got.error_of("clip", "gradient norm"), got.worst(),
                    floor, got.within(tol)) for s, (loss, got, floor) in enumerate(steps)]
    first = next(((f, got) for _, got, _ in steps for f in got.findings if not f.error <= limit(f, tol)), None)
    seconds = {"reference": ref.seconds, **({"noise": noise.seconds} if noise else {}), "engine": engine.seconds}
    report = Report(_title(plan, ref, engine, tol), rows, tol, noise_floor, None, notes=list(plan.notes),
                    seconds=seconds)
    report.notes += causes.run_notes(plan, ref, engine)
    if first is not None:
        report.first = first[0]
        report.where, report.cause = causes.diagnose(first[0], first[1], plan, ref, engine)
    return report


def _title(plan: Plan, ref: Records, engine: Records, tol: Tolerance) -> str:
    m = engine.meta
    against = "one process" if ref.world == 1 else f"{plan.against} on {ref.world} ranks"
    return (f"{m['strategy']} on {engine.world} ranks vs {against}, {tol.dtype_name}, {plan.steps} steps: "
            f"{m['accumulation']} micro batch(es) of {m['micro']} per rank per step, the reference "
            f"{ref.meta['accumulation']} of {ref.meta['micro']}")

