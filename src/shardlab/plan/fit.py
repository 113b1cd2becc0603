"""Fitting the loopback link's alpha-beta constants on this machine, per collective kind
(`python -m shardlab.plan fit-loopback`): the engines' own collectives timed at 2 workers
(fit) and checked at 4 (docs/memory.md, "Step time")."""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from shardlab.engines import collectives as c
from shardlab.plan.catalogue import Link
from shardlab.plan.traffic import collective_time
from shardlab.testing import run_workers

FIT_SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)   # bytes of the full buffer
FIT_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def _time_collectives(rank: int, world: int, sizes: tuple[int, ...], repeats: int) -> list[tuple[str, int, float]]:
    out = []
    for nbytes in sizes:
        n = nbytes // 4
        full = torch.ones(n - n % world)
        shard = torch.ones(full.numel() // world)
        # the engines' own collectives (on CPU: [Note: flat collectives on CPU, without gloo's temporaries])
        ops = {"all_reduce": lambda f=full: c.all_reduce(f),
               "all_gather": lambda f=full, s=shard: c.all_gather_into(f, s),
               "reduce_scatter": lambda f=full, s=shard: c.reduce_scatter_into(s, f, average=False),
               "broadcast": lambda f=full: c.broadcast(f, 0),
               "reduce": lambda f=full: c.reduce(f, 0)}
        for kind, op in ops.items():
            op()  # warm-up
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                times.append(time.perf_counter() - t0)
            out.append((kind, full.numel() * 4, sorted(times)[len(times) // 2]))
    return out


def measure_collectives(world: int, sizes: tuple[int, ...] = FIT_SIZES, repeats: int = 5) -> list[tuple[str, int, float]]:
    """Median seconds of each collective kind and size on `world` local gloo workers (rank 0's clock)."""
    return run_workers(world, _time_collectives, sizes, repeats, timeout_s=600)[0]


def fit_per_kind(samples: list[tuple[str, int, float]], world: int) -> tuple[tuple[str, float, float], ...]:
    """fit_alpha_beta for each collective kind on its own: ((kind, alpha_s, bandwidth), ...)."""
    kinds = sorted({k for k, _, _ in samples})
    return tuple((k, *fit_alpha_beta([x for x in samples if x[0] == k], world)) for k in kinds)


def fit_alpha_beta(samples: list[tuple[str, int, float]], world: int) -> tuple[float, float]:
    """Least squares of t = alpha * steps + bus_bytes / bandwidth over every kind and size, with
    the ring model of `collective_time`; returns (alpha_s, bandwidth)."""
    unit = Link("unit", 1.0, 1.0, "")
    rows, ts = [], []
    for kind, nbytes, t in samples:
        steps = collective_time(kind, 0, world, unit)            # alpha coefficient
        bus = collective_time(kind, nbytes, world, Link("b", 0.0, 1.0, ""))  # bytes on the bus
        rows.append([steps / t, bus / t])                        # relative errors: divide by t
        ts.append(1.0)
    (alpha, inv_bw), *_ = np.linalg.lstsq(np.array(rows), np.array(ts), rcond=None)
    return float(alpha), float(1.0 / inv_bw)


def main(argv: list[str] | None = None) -> int:
    """python -m shardlab.plan fit-loopback: fit loopback's alpha-beta at 2 workers, check at 4."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["fit-loopback"]:
        print("usage: python -m shardlab.plan fit-loopback [--check-world 4]", file=sys.stderr)
        return 2
    check = int(argv[argv.index("--check-world") + 1]) if "--check-world" in argv else 4
    repeats = int(argv[argv.index("--repeats") + 1]) if "--repeats" in argv else 15
    s2 = measure_collectives(2, repeats=repeats)
    alpha, bw = fit_alpha_beta(s2, 2)
    one = Link("loopback-fit", alpha, bw, "fit")
    per_kind = fit_per_kind(s2, 2)
    each = Link("loopback-fit-per-kind", alpha, bw, "fit", per_kind)
    print(f"fit at 2 workers, one pair: alpha = {alpha * 1e6:.1f} us, bandwidth = {bw / 1e9:.3f} GB/s")
    for k, a, b in per_kind:
        print(f"fit at 2 workers, {k}: alpha = {a * 1e6:.1f} us, bandwidth = {b / 1e9:.3f} GB/s")
    s_check = measure_collectives(check, repeats=repeats)
    for label, samples, w in (("2 workers (fit)", s2, 2), (f"{check} workers (check)", s_check, check)):
        print(f"{label}: kind, bytes, measured ms, predicted ms (one pair / per kind), error (one pair / per kind)")
        errs: dict[str, list[float]] = {"one": [], "each": []}
        for kind, nbytes, t in samples:
            p1, p2 = collective_time(kind, nbytes, w, one), collective_time(kind, nbytes, w, each)
            errs["one"].append(abs(p1 - t) / t)
            errs["each"].append(abs(p2 - t) / t)
            print(f"  {kind:15s} {nbytes:10d} {t * 1e3:9.3f} {p1 * 1e3:9.3f} {p2 * 1e3:9.3f} "
                  f"{100 * (p1 - t) / t:+6.1f}% {100 * (p2 - t) / t:+6.1f}%")
        for name, e in errs.items():
            e.sort()
            print(f"  {'one pair' if name == 'one' else 'per kind'}: mean |error| {100 * sum(e) / len(e):.1f}%, "
                  f"median {100 * e[len(e) // 2]:.1f}%")
    return 0
