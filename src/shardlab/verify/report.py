"""verify's report as text: the table (step x loss, gradient norm, worst quantity; error vs
tolerance), the verdict, and for the first difference where it is and its likely cause."""

from __future__ import annotations

import math
import textwrap

from shardlab.verify.compare import Finding, Report

PHASE_NAMES = {"forward": "forward", "backward": "gradient", "clip": "clip", "step": "after step",
               "buffers": "buffer"}


def _e(x: float | None) -> str:
    return "-" if x is None else "inf" if math.isinf(x) else f"{x:.1e}"


def _quantity(f: Finding) -> str:
    if f.phase == "forward" and f.name != "loss":
        return f"output of {f.name}"
    return f"{PHASE_NAMES[f.phase]} {f.name}" if f.phase != "forward" else "loss"


def format_report(r: Report) -> str:
    tol = r.tolerance
    lines = [f"shardlab verify: {r.title}"]
    lines += [f"  note: {n}" for n in r.notes]
    lines.append(f"tolerance {_e(tol.value)} (relative error; {tol.why})")
    if r.noise_floor is None:
        lines.append("noise floor not measured (--keep-dropout: reversing rows would change the dropout masks)")
    else:
        lines.append(f"noise floor {_e(r.noise_floor)} (the reference again with each micro batch's rows reversed: "
                     "the same maths, another rounding)")
    lines.append("")
    width = max([34] + [len(_quantity(row.worst)) for row in r.rows])
    lines.append(f"{'step':>4}  {'loss':>10}  {'loss err':>8}  {'norm err':>8}  {'worst':<{width}}  "
                 f"{'error':>8}  {'noise':>8}")
    for row in r.rows:
        ok = "ok" if row.ok else "DIFFERS"
        lines.append(f"{row.step:>4}  {row.loss:>10.6g}  {_e(row.loss_error):>8}  {_e(row.grad_norm_error):>8}  "
                     f"{_quantity(row.worst):<{width}}  {_e(row.worst.error):>8}  {_e(row.noise):>8}  {ok}")
    lines.append("")
    lines += _verdict(r)
    times = ", ".join(f"{k} {v:.1f} s" for k, v in r.seconds.items())
    lines.append(f"time: {times}")
    return "\n".join(lines)


def _verdict(r: Report) -> list[str]:
    tol = r.tolerance
    if not tol.useful:
        return [f"INCONCLUSIVE: the tolerance is {_e(tol.value)}, too wide to tell a fault (a gradient off by N "
                "gives 0.5 or more) from rounding here. Verify in float64 (the default)."]
    if r.first is None:
        return [f"EQUAL: every loss, gradient, gradient norm, parameter and buffer within the tolerance "
                f"{_e(tol.value)}.", _worst_line(r)]
    f = r.first
    rank = f" (rank {f.rank})" if f.rank is not None else ""
    out = [f"NOT EQUAL. First difference: step {f.step}, phase {f.phase}: {_quantity(f)}{rank}, error "
           f"{_e(f.error)} > tolerance", f"  where: {r.where}"]
    return out + textwrap.wrap(r.cause or "", width=100, initial_indent="  likely cause: ", subsequent_indent="    ")


def _worst_line(r: Report) -> str:
    """The largest error of the run beside the noise floor, both as numbers: how far from rounding
    the engine came, not how far the tolerance is from the floor."""
    worst = max((row.worst for row in r.rows), key=lambda f: f.error, default=None)
    if worst is None:
        return "No quantity was compared."
    where = f"{_quantity(worst)} at step {worst.step}"
    if r.noise_floor is None:
        return f"The worst error is {_e(worst.error)} ({where}); the noise floor was not measured."
    if r.noise_floor == 0:
        return f"The worst error is {_e(worst.error)} ({where}); the noise floor is 0 (the rows' order changed nothing)."
    return (f"The worst error is {_e(worst.error)} ({where}), {worst.error / r.noise_floor:.1f}x the noise floor "
            f"{_e(r.noise_floor)}.")


def print_report(r: Report) -> None:
    print(format_report(r), flush=True)
