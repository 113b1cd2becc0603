"""Hybrid sharding (parallel.shard_size) and CPU offload (parallel.offload=cpu) equal one process.

One spawn per world size, every case inside it (process start-up dominates; N=4 on two cores
is slow, so the models are the parity harness's tiny ones and runs are 3 steps):
- N=4: the CPU forms of the flat collectives against torch's, whole group and subgroup;
  fsdp and torch-fsdp with S=2 (HSDP: shard groups {0,1},{2,3}, replica groups {0,2},{1,3})
  and fsdp with S=4 (plain FSDP), SGD and AdamW, with accumulation (no_sync) and clipping;
  the traffic of one step per group against the formulas of docs/engines.md; model state per
  rank 16 Psi / S; a checkpoint written by HSDP read by FSDP, DDP, torch-fsdp HSDP and zero3
  (and a DDP one by HSDP with offload), each saved again bit for bit the same.
- N=2: offload parity for fsdp, zero3 and torch-fsdp; the N=4 HSDP checkpoint read at N=2.
The parent compares against `single` at the harness's float64 tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch

import shardlab
from shardlab import cli
from shardlab.config import ConfigError, load_config, validate_for_world
from shardlab.engines import engine_of, optimizer_state_bytes
from shardlab.loop import train as T
from shardlab.testing import run_workers
from tests.checkpoint_helpers import assert_same_tensors, load_and_resave, make_cfg, runtime
from tests.engine_internals import comm_stats_by_group
from tests.parity import (
    GLOBAL_BATCH,
    assert_parity,
    batch,
    build,
    make_optimizer,
    train_engine,
    train_reference,
)

CLIP = 0.05

# (strategy, case, optimizer, accumulate, clip, options)
PARITY4 = [
    ("fsdp", "gpt", "sgd", 3, CLIP, {"shard_size": 2}),
    ("fsdp", "gpt", "adamw", 1, CLIP, {"shard_size": 2}),
    ("fsdp", "mlp", "adamw", 3, None, {"shard_size": 2}),
    ("fsdp", "frozen", "adamw", 1, None, {"shard_size": 2}),
    ("fsdp", "gpt", "adamw", 3, CLIP, {"shard_size": 4}),
    ("fsdp", "mlp", "sgd", 1, CLIP, {"shard_size": 4}),
    ("torch-fsdp", "gpt", "sgd", 3, CLIP, {"shard_size": 2}),
    ("torch-fsdp", "gpt", "adamw", 1, CLIP, {"shard_size": 2}),
]
PARITY2 = [
    ("fsdp", "gpt", "adamw", 3, CLIP, {"offload": "cpu"}),
    ("fsdp", "mlp", "sgd", 1, CLIP, {"offload": "cpu", "shard_size": 1}),
    ("zero3", "gpt", "sgd", 3, CLIP, {"offload": "cpu"}),
    ("zero3", "mlp", "adamw", 1, None, {"offload": "cpu"}),
    ("torch-fsdp", "gpt", "adamw", 3, CLIP, {"offload": "cpu"}),
]


def _label(case: tuple) -> str:
    strategy, name, opt, acc, clip, options = case
    return f"{strategy} {name} {opt} acc={acc} clip={clip} {options}"


# ------------------------------------------------------------------------------- in the workers
def _traffic_and_state(rank: int, world: int, shard_size: int) -> dict:
    """One synchronized AdamW step of gpt in fp32: bytes per collective kind and group, and
    the model state this rank keeps (shards, their gradients, Adam's two moments)."""
    model = shardlab.parallelize(build("gpt", "meta", torch.float32), "fsdp", device="cpu", shard_size=shard_size)
    engine = engine_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch("gpt", 0, torch.float32)
    b = GLOBAL_BATCH // world
    before = comm_stats_by_group(engine)
    model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]).backward()
    after = comm_stats_by_group(engine)
    opt.step()
    delta = {grp: {kind: {k: v - before[grp].get(kind, {}).get(k, 0) for k, v in totals.items()}
                   for kind, totals in kinds.items()} for grp, kinds in after.items()}
    state = engine.model_state_bytes()
    root = engine.root_unit.groups if engine.root_unit is not None else []
    return {
        "traffic": delta,
        "groups": [(g.full.numel(), g.shard.numel(), g.trainable) for g in engine.groups],
        "root_padded": sum(g.full.numel() for g in root),
        "state_bytes": state["params"] + state["grads"] + optimizer_state_bytes(opt),
        "psi": sum(p.numel() for p in build("gpt", "meta").parameters()),
        "hybrid": (engine.hybrid.shard_ranks, engine.hybrid.replica_ranks, engine.shard_rank),
        "shards": [g.shard.detach().clone() for g in engine.groups],
    }


def _collectives_against_torch(rank: int, world: int) -> dict:
    """collectives.all_gather_into and reduce_scatter_into take the in-place CPU forms ([Note:
    flat collectives on CPU, without gloo's temporaries]); torch's flat collectives are the
    reference, over the whole group and over a 2-rank subgroup (HSDP's case: the broadcasts'
    sources are group ranks mapped to global ones), blocking and async, in float64 with
    values whose sums are exact. Each call counts as one call of its kind."""
    import torch.distributed as dist

    from shardlab.engines import collectives

    subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mismatches, counts = [], collectives.CommCounter()
    for group in (None, subgroups[rank // 2]):
        n = dist.get_world_size(group)
        for async_op in (False, True):
            shard = torch.arange(5, dtype=torch.float64) + 10 * rank
            full, want = torch.empty(5 * n, dtype=torch.float64), torch.empty(5 * n, dtype=torch.float64)
            work = collectives.all_gather_into(full, shard, group, async_op=async_op, counter=counts)
            if work is not None:
                work.wait()
            dist.all_gather_into_tensor(want, shard, group=group)
            mismatches += [] if torch.equal(full, want) else [("all_gather", group is None, async_op)]
            grad = torch.arange(4 * n, dtype=torch.float64) * (rank + 1)
            out, want = torch.empty(4, dtype=torch.float64), torch.empty(4, dtype=torch.float64)
            dist.reduce_scatter_tensor(want, grad.clone(), group=group)
            work = collectives.reduce_scatter_into(out, grad, group, average=False, async_op=async_op, counter=counts)
            if work is not None:
                work.wait()
            mismatches += [] if torch.equal(out, want) else [("reduce_scatter", group is None, async_op)]
    return {"mismatches": mismatches, "calls": {k: v["calls"] for k, v in collectives.merged_totals([counts]).items()}}


HSDP2 = ("parallel.shard_size=2",)
CKPT_ARGS = ("model.dropout=0.0", "train.micro_batch_size=1")


def _four(rank: int, world: int, out: str) -> dict:
    res: dict = {"parity": [train_engine(rank, world, name, strategy, opt, micro_batches=acc, clip=clip, **options)
                            for strategy, name, opt, acc, clip, options in PARITY4]}
    res["traffic"] = {s: _traffic_and_state(rank, world, s) for s in (2, 4)}
    res["collectives"] = _collectives_against_torch(rank, world)
    # an HSDP checkpoint written by the training loop (config keys -> engine options), after 2 steps
    cfg = make_cfg("fsdp", out, "hsdp", *CKPT_ARGS, *HSDP2, steps=2, every=2)
    T.train(cfg, runtime(rank, world, "fsdp"))
    source = os.path.join(out, "hsdp", "checkpoints", "step_00000002")
    targets = {"fsdp-S4": ("fsdp", ("parallel.shard_size=4",)), "ddp": ("ddp", ()),
               "torch-fsdp-S2": ("torch-fsdp", HSDP2), "zero3": ("zero3", ())}
    res["resaved"] = {k: load_and_resave(rank, world, s, source, os.path.join(out, k), out, extra)
                      for k, (s, extra) in targets.items()}
    res["resaved"]["ddp->hsdp-offload"] = load_and_resave(rank, world, "fsdp", res["resaved"]["ddp"],
                                                          os.path.join(out, "ddp-hsdp"), out,
                                                          (*HSDP2, "parallel.offload=cpu"))
    res["source"] = source
    return res


def _two(rank: int, world: int, four_source: str, out: str) -> dict:
    res: dict = {"parity": [train_engine(rank, world, name, strategy, opt, micro_batches=acc, clip=clip, **options)
                            for strategy, name, opt, acc, clip, options in PARITY2]}
    placement = {}
    for strategy in ("fsdp", "zero3", "torch-fsdp"):
        model = shardlab.parallelize(build("mlp", "meta"), strategy, device="cpu", offload="cpu")
        opt = make_optimizer("adamw", model.parameters())
        x, y = batch("mlp", 0)
        model(x, y).backward()
        opt.step()
        params = list(model.parameters())
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        placement[strategy] = {
            "params": {t.device.type for t in local},
            "grads": {(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).device.type
                      for p in params if p.grad is not None},
            "optim": {v.device.type for st in opt.state.values() for v in st.values() if v.dim()},
            "pinned": any(t.is_pinned() for t in local),
        }
    res["placement"] = placement
    res["resaved"] = {k: load_and_resave(rank, world, s, four_source, os.path.join(out, k), out, extra)
                      for k, (s, extra) in {"fsdp-S1": ("fsdp", ("parallel.shard_size=1",)),
                                            "fsdp-S2": ("fsdp", ("parallel.shard_size=2", "parallel.offload=cpu")),
                                            "torch-fsdp-S1": ("torch-fsdp", ("parallel.shard_size=1",))}.items()}
    return res


# ------------------------------------------------------------------------------- in the parent
@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hsdp4"))
    ranks = run_workers(4, _four, out, timeout_s=300)
    return {"out": out, "ranks": ranks, **ranks[0]}


@pytest.fixture(scope="module")
def two(tmp_path_factory, four):
    out = str(tmp_path_factory.mktemp("hsdp2"))
    return run_workers(2, _two, four["source"], out, timeout_s=240)


@pytest.mark.parametrize("i", range(len(PARITY4)), ids=[_label(c) for c in PARITY4])
def test_hsdp_parity_with_single(four, i):
    strategy, name, opt, acc, clip, options = PARITY4[i]
    assert_parity(train_reference(name, opt, clip=clip), four["parity"][i], _label(PARITY4[i]))


@pytest.mark.parametrize("i", range(len(PARITY2)), ids=[_label(c) for c in PARITY2])
def test_offload_parity_with_single(two, i):
    strategy, name, opt, acc, clip, options = PARITY2[i]
    assert_parity(train_reference(name, opt, clip=clip), two[0]["parity"][i], _label(PARITY2[i]))


def test_offload_keeps_shards_grads_and_optimizer_state_on_the_host(two):
    for strategy, where in two[0]["placement"].items():
        assert where["params"] == where["grads"] == where["optim"] == {"cpu"}, (strategy, where)
        assert where["pinned"] == torch.cuda.is_available(), strategy  # pinned only where CUDA exists


def test_hsdp_groups_and_replicas(four):
    """Shard groups are consecutive ranks, replica groups strided; replicas hold equal shards."""
    hybrid = [r["traffic"][2]["hybrid"] for r in four["ranks"]]
    assert hybrid == [((0, 1), (0, 2), 0), ((0, 1), (1, 3), 1), ((2, 3), (0, 2), 0), ((2, 3), (1, 3), 1)]
    shards = [r["traffic"][2]["shards"] for r in four["ranks"]]
    for a, b in ((0, 2), (1, 3)):  # the two replicas of each shard, after a step: equal
        assert all(torch.equal(x, y) for x, y in zip(shards[a], shards[b]))
    assert not all(torch.equal(x, y) for x, y in zip(shards[0], shards[1]))  # different shards


def test_traffic_per_group_matches_the_formulas(four):
    """One synchronized step. Shard group (S ranks): all-gather of every group in forward and of
    every group but the root's in backward, reduce-scatter of the trainable groups (payload =
    padded full size; bus = payload (S-1)/S). Replica group (R = N/S): all-reduce of each
    trainable shard (payload = padded/S; bus = payload 2(R-1)/R). S = N: no all-reduce."""
    for s in (2, 4):
        t = four["traffic"][s]
        r = 4 // s
        shard, replica = t["traffic"]["shard"], t["traffic"]["replicate"]
        padded = [full * 4 for full, _, _ in t["groups"]]
        trainable = [(full * 4, sh * 4) for full, sh, tr in t["groups"] if tr]
        gathered = 2 * sum(padded) - t["root_padded"] * 4
        assert shard["all_gather"]["payload_bytes"] == gathered
        assert shard["reduce_scatter"]["payload_bytes"] == sum(f for f, _ in trainable)
        assert shard["reduce_scatter"]["calls"] == len(trainable)
        assert shard["reduce_scatter"]["bus_bytes"] == sum(int(f * (s - 1) / s) for f, _ in trainable)
        if r == 1:
            assert "all_reduce" not in replica and "all_reduce" not in shard
        else:
            ar = replica["all_reduce"]
            assert ar["payload_bytes"] == sum(sh for _, sh in trainable) == sum(f for f, _ in trainable) // s
            assert ar["calls"] == len(trainable)
            assert ar["bus_bytes"] == sum(int(sh * 2 * (r - 1) / r) for _, sh in trainable)


def test_cpu_collectives_equal_torchs_flat_collectives(four):
    for r in four["ranks"]:
        assert r["collectives"]["mismatches"] == [], r["collectives"]
        assert r["collectives"]["calls"] == {"all_gather": 4, "reduce_scatter": 4}


def test_model_state_is_16_psi_over_shard_size(four):
    for s in (2, 4):
        t = four["traffic"][s]
        shard_numel = sum(sh for _, sh, _ in t["groups"])
        assert t["state_bytes"] == 16 * shard_numel  # 4 shard + 4 grad + 8 Adam, all trainable in gpt
        psi, groups = t["psi"], len(t["groups"])
        assert 16 * psi / s <= t["state_bytes"] < 16 * (psi + groups * s) / s  # padding < S per group


def test_hsdp_checkpoint_round_trips_across_engines_and_world_sizes(four, two):
    src = four["source"]
    for name, path in four["resaved"].items():
        assert assert_same_tensors(src, path) > 0, name
    for name, path in two[0]["resaved"].items():
        assert assert_same_tensors(src, path) > 0, name


def _distcp_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))


def test_hsdp_checkpoint_writes_each_piece_once(four):
    """With R = 2 replicas every piece is held twice; DCP keeps one writer per identical chunk,
    so the HSDP checkpoint is no larger than the plain FSDP one of the same state."""
    hsdp, fsdp = _distcp_bytes(four["source"]), _distcp_bytes(four["resaved"]["fsdp-S4"])
    assert hsdp <= 1.05 * fsdp, (hsdp, fsdp)


# ------------------------------------------------------------------------------- config, no workers
@pytest.mark.parametrize("overrides,world,fragments", [
    (["parallel.shard_size=3"], 4, ["parallel.shard_size=3 must divide the world size 4", "[1, 2, 4]"]),
    (["parallel.shard_size=8"], 4, ["parallel.shard_size=8 must divide the world size 4"]),
    (["parallel.shard_size=0"], 4, ["parallel.shard_size must be >= 1"]),
    (["parallel.strategy=ddp", "parallel.shard_size=2"], 4, ["applies to parallel.strategy=fsdp or torch-fsdp"]),
    (["parallel.strategy=ddp", "parallel.offload=cpu"], 2, ["parallel.offload=cpu needs a sharded engine"]),
    (["parallel.offload=gpu"], 2, ["parallel.offload: unknown value 'gpu'", "none, cpu"]),
])
def test_bad_shard_size_or_offload_fails_before_workers(overrides, world, fragments, monkeypatch, capsys):
    import shardlab.loop.launcher

    monkeypatch.setattr(shardlab.loop.launcher, "launch_local",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("a worker was started")))
    code = cli.main(["train", "--nproc", str(world), "train.global_batch_size=16", "train.micro_batch_size=1",
                     *overrides])
    err = capsys.readouterr().err
    assert code == 2
    for fragment in fragments:
        assert fragment in err, err


def test_default_shard_size_is_the_ranks_per_node(monkeypatch):
    from shardlab.engines.collectives import resolve_shard_size

    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_shard_size(None, 8) == 8          # unknown: plain FSDP over everyone
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_shard_size(None, 8) == 4          # 2 nodes of 4: shard within a node
    assert resolve_shard_size(None, 4) == 4
    assert resolve_shard_size(2, 8) == 2             # explicit wins
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    assert resolve_shard_size(None, 8) == 4          # torchrun's LOCAL_WORLD_SIZE first
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert resolve_shard_size(None, 8) == 2          # srun-started workers: Slurm's tasks per node
    monkeypatch.delenv("SLURM_PROCID")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    cfg = load_config(None, ["train.global_batch_size=8", "train.micro_batch_size=1"])
    with pytest.raises(ConfigError, match="defaults to the ranks per node \\(3\\).*set parallel.shard_size"):
        validate_for_world(cfg, 8)
