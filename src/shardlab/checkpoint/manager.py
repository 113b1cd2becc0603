"""The save and resume policy: `CheckpointManager` (every rank calls every method)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from shardlab.atomic import disk_full_errno, remove_tree, write_json_atomic
from shardlab.checkpoint.format import (
    DCP_METADATA,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    _fsync_dir,
    step_dir_name,
)
from shardlab.checkpoint.integrity import HASH_KEY, SafeReader, check_file_hashes, dcp_load, file_sha256
from shardlab.checkpoint.loading import Reads, compatibility_error, plan_reads, restore_param_groups
from shardlab.checkpoint.planners import (
    _flat_local,
    _FlatPieceLoadPlanner,
    _FlatPieceSavePlanner,
    _model_buffers,
    _Piece,
    checkpoint_layout,
)
from shardlab.checkpoint.reader import (
    _state_dict_keys,
    list_checkpoints,
    resolve_checkpoint,
    verify_checkpoint,
)
from shardlab.checkpoint.rng import capture_rng, restore_rng
from shardlab.checkpoint.space import RecordingWriter, agree_save, fresh_directory
from shardlab.checkpoint.stage import StageCopy
from shardlab.engines.api import engine_of
from shardlab.models import model_record

log = logging.getLogger("shardlab.checkpoint")


# ============================================================================ the manager
class CheckpointManager:
    """Saves and restores the whole training state; every rank calls every method.

    [Note: every rank calls] Saving and loading run collectives (DCP's plan exchange, the
    agreement on which checkpoint to load, error propagation). A rank that skipped one would
    leave the others blocked until the timeout, so nothing here is `if rank == 0` except
    plain file operations (the manifest, the rename, pruning), and errors found on one rank
    are shared so that all ranks raise together instead of some waiting forever.
    """

    def __init__(self, root: str, rt: Any, *, every_steps: int = 0, keep_last: int = 2, resume: str = "auto",
                 async_save: bool = False, timeout_s: float = 300.0, config: Any = None, final: bool = False):
        self.root = root
        self.rt = rt
        self.every_steps = every_steps
        self.final = final   # checkpoint.final: the last step is saved even when every_steps is 0
        self.keep_last = keep_last
        self.resume = resume
        self.async_save = async_save
        self.config = config
        self.last_saved_step: int | None = None
        self.last_save_seconds: float | None = None
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._commit_error: BaseException | None = None
        self._commit_done = threading.Event()
        self._shapes: dict[str, list[int]] | None = None
        self._group = None
        if async_save and self._distributed:
            # [Note: async group] The background save runs DCP's collectives (plan gather,
            # metadata scatter) while the training thread runs its own all-reduces. On one
            # gloo group they interleave in different orders on different ranks and hang (seen
            # with DDP on gloo); a group of its own keeps the two streams apart. Every rank
            # creates it here, at the same point of the program.
            import datetime

            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    @classmethod
    def from_config(cls, cfg: Any, out_dir: str, rt: Any) -> CheckpointManager:
        c = cfg.checkpoint
        return cls(c.dir or os.path.join(out_dir, "checkpoints"), rt, every_steps=c.every_steps,
                   keep_last=c.keep_last, resume=c.resume, async_save=c.async_save,
                   timeout_s=cfg.parallel.timeout_s, config=cfg, final=c.final)

    # -- collectives ------------------------------------------------------------------------------
    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.rt.world_size > 1

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * self.rt.world_size
        dist.all_gather_object(out, obj)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _agree(self, error: str | None) -> None:
        """Raise the same CheckpointError on every rank if any rank found a problem."""
        errors = [e for e in self._all_gather(error) if e]
        if errors:
            raise CheckpointError(errors[0])

    def _param_shapes(self, layout) -> dict[str, list[int]]:
        """Every original parameter's full shape, over all ranks (a rank may hold none of one)."""
        if self._shapes is None:
            local = {pc.name: list(pc.full_shape) for _, pieces in layout for pc in pieces}
            merged: dict[str, list[int]] = {}
            for d in self._all_gather(local):
                merged.update(d)
            self._shapes = dict(sorted(merged.items()))
        return self._shapes

    # -- the training loop's interface ------------------------------------------------------------
    def maybe_resume(self, model: nn.Module, opt, sched, state) -> str | None:
        """Load the checkpoint `checkpoint.resume` names: auto = the latest complete one under
        the checkpoint dir if any (so a restarted worker group continues), none, or a path."""
        if self.resume == "none":
            return None
        if self.resume == "auto":
            found = list_checkpoints(self.root) if self.rt.rank == 0 else None
            path = self._broadcast(found[-1][1] if found else None)
            if path is None:
                return None
        else:
            path = self.resume
        self.load(path, model, opt, sched, state)
        return path

    def due(self, step: int) -> bool:
        """checkpoint.every_steps asks for this step, not saved yet."""
        return self.every_steps > 0 and step % self.every_steps == 0 and step != self.last_saved_step

    def final_due(self, step: int) -> bool:
        """The end of training saves its step (checkpoint.final, or every_steps > 0), unless just saved."""
        return (self.final or self.every_steps > 0) and step != self.last_saved_step

    def maybe_save(self, model: nn.Module, opt, sched, state) -> str | None:
        if self.due(state.step):
            self.refuse_non_finite(model, state.step)
            return self.save(model, opt, sched, state)
        return None

    def refuse_non_finite(self, model: nn.Module, step: int) -> None:
        """The loss of step s is computed before step s's update, so a non-finite gradient turns
        the parameters to NaN one step before the loss shows it. Saving them would replace the
        last good checkpoint by a poisoned one: check first (all ranks decide together)."""
        bad = [n for p, ps in checkpoint_layout(model) for n in [ps[0].name if ps else "(padding)"]
               if not torch.isfinite(_flat_local(p)).all()]
        if any(self._all_gather(bool(bad))):
            last = self.last_saved_step
            raise FloatingPointError(
                f"non-finite parameters at step {step} (e.g. {bad[:3] or 'on another rank'}): checkpoint not "
                f"written; the last good checkpoint is step {last} in {self.root}. Lower train.lr or enable "
                "train.grad_clip, then resume from it.")

    def finalize(self, model: nn.Module, opt, sched, state) -> str | None:
        """At the end of training: the final state is saved (checkpoint.final, or every_steps > 0),
        unless that step was just saved, and every in-flight asynchronous save is committed."""
        path = None
        if self.final_due(state.step):
            path = self.save(model, opt, sched, state, blocking=True)
        self.wait()
        return path

    # -- save -------------------------------------------------------------------------------------
    def _collect(self, model: nn.Module, opt, state, stage: bool):
        """(plain entries, flat pieces, description) of what this rank saves. stage=True copies
        everything, so training may modify the live tensors while a background save writes."""
        copy = StageCopy(self.rt.device, stage)  # pinned host memory on CUDA: stage.py
        layout = checkpoint_layout(model)
        shapes = self._param_shapes(layout)
        plain: dict[str, torch.Tensor] = {}
        pieces: list[_Piece] = []
        tensor_keys: set[str] = set()
        scalar_keys: set[str] = set()
        for p, ps in layout:
            flat = _flat_local(p)
            st = opt.state.get(p, {}) if opt is not None else {}
            for pc in ps:
                numel = math.prod(pc.full_shape)
                pieces.append(_Piece(f"model/{pc.name}", pc.offset, numel,
                                     copy(flat[pc.local_start:pc.local_start + pc.numel])))
                for key, v in st.items():
                    fqn = f"optim/{pc.name}/{key}"
                    if isinstance(v, torch.Tensor) and v.dim() == 0:
                        plain[fqn] = copy(v)
                        scalar_keys.add(key)
                    elif isinstance(v, torch.Tensor) and _flat_local(v).numel() == flat.numel():
                        sflat = _flat_local(v)
                        pieces.append(_Piece(fqn, pc.offset, numel, copy(sflat[pc.local_start:pc.local_start + pc.numel])))
                        tensor_keys.add(key)
                    else:
                        raise CheckpointError(f"optimizer state {key!r} of {pc.name!r} is a {type(v).__name__}: "
                                              "only tensors shaped like the parameter and 0-dim tensors are saved")
        buffers = _model_buffers(model)
        for name, b in buffers.items():
            plain[f"model/{name}"] = copy(b)
        plain.update(capture_rng(self.rt.rank))
        copy.done()
        desc = {"params": shapes, "buffers": {k: list(b.shape) for k, b in buffers.items()},
                "optim_tensor_keys": sorted(tensor_keys), "optim_scalar_keys": sorted(scalar_keys)}
        return plain, pieces, desc

    def _manifest(self, model, opt, sched, state, desc_all: list[dict], world_size: int) -> dict[str, Any]:
        desc = desc_all[0]
        record = None  # what it takes to rebuild the model without the training data (export, generate)
        if self.config is not None:
            record = model_record(self.config.model.name, engine_of(model).unwrapped(), self.config.seed)
        sched_state = None
        if sched is not None:
            sched_state = {k: v for k, v in sched.state_dict().items() if _jsonable(v)}
        return {
            "format": FORMAT, "version": FORMAT_VERSION,
            "step": state.step,
            "world_size": world_size,
            "strategy": engine_of(model).strategy,
            "params": desc["params"],
            "buffers": desc["buffers"],
            "state_dict_keys": _state_dict_keys(record),
            "optimizer": None if opt is None else {
                "class": type(opt).__name__,
                "param_groups": [{k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in opt.param_groups],
                "tensor_keys": sorted({k for d in desc_all for k in d["optim_tensor_keys"]}),
                "scalar_keys": sorted({k for d in desc_all for k in d["optim_scalar_keys"]}),
            },
            "scheduler": sched_state,
            "train_state": dataclasses.asdict(state),  # TrainState: JSON values only
            "rng_world_size": world_size,
            "model": record,
            "config": self.config.to_dict() if self.config is not None else None,
            "saved_unix_time": time.time(),
        }

    def save(self, model: nn.Module, opt, sched, state, *, blocking: bool | None = None) -> str:
        """Write a checkpoint of step `state.step`. Synchronous unless checkpoint.async (then it
        returns once the state is copied; the write and commit finish in the background)."""
        blocking = (not self.async_save) if blocking is None else blocking
        self.wait()  # one save in flight at most: its commit must precede pruning by the next
        t0 = time.perf_counter()
        final = os.path.join(self.root, step_dir_name(state.step))
        tmp, step = final + ".tmp", state.step
        fresh_directory(self, step, tmp)  # rank 0 makes a fresh step_N.tmp; also the barrier
        plain, pieces, desc = self._collect(model, opt, state, stage=not blocking)
        desc_all = self._all_gather(desc)
        manifest = self._manifest(model, opt, sched, state, desc_all, self.rt.world_size)
        planner = _FlatPieceSavePlanner(pieces)
        writer = RecordingWriter(tmp, sync_files=True)  # keeps a full disk's errno (checkpoint/space.py)
        if blocking:
            try:
                dcp.save(plain, storage_writer=writer, planner=planner, no_dist=not _dist_ready())
            except CheckpointException:  # raised on every rank together; a full disk: DiskFullError everywhere
                agree_save(self, step, tmp, None, writer.errno)
                raise
            except Exception as e:
                raise CheckpointError(f"rank {self.rt.rank}: saving checkpoint step {step} failed ({e}); if another "
                                      "rank died, its log says why; the previous checkpoint is intact") from e
            hashes, hash_s = self._hash_own_files(tmp)
            error = self._commit(tmp, final, manifest, t0, hashes, hash_s) if self.rt.rank == 0 else None
            agree_save(self, step, tmp, error, self.commit_full)
            self.last_saved_step = step
            return final
        fut = dcp.async_save(plain, storage_writer=writer, planner=planner, process_group=self._group)
        self._pending, self._pending_step, self._pending_writer = fut, step, writer
        self._commit_error = None
        self._commit_done.clear()
        if self.rt.rank == 0:
            # DCP's coordinator writes .metadata only after every rank reported its writes done,
            # so when rank 0's future resolves the data of all ranks is on disk: commit right away.
            def on_done(f: Future) -> None:
                try:
                    f.result()
                    err = self._commit(tmp, final, manifest, t0)
                    if err:
                        self._commit_error = CheckpointError(err)
                except BaseException as e:  # noqa: BLE001 - reported by wait()
                    self._commit_error = e
                finally:
                    self._commit_done.set()
            fut.add_done_callback(on_done)
        else:
            self._commit_done.set()
        self.last_saved_step = step
        return final

    def wait(self) -> None:
        """Finish the in-flight asynchronous save (every rank calls); raise if it failed anywhere."""
        if self._pending is None:
            return
        fut, step, writer = self._pending, self._pending_step, self._pending_writer
        self._pending = None
        error = None
        try:
            fut.result()
        except BaseException as e:  # noqa: BLE001
            error = f"rank {self.rt.rank}: asynchronous save of step {step} failed: {e}"
        self._commit_done.wait()
        if error is None and self._commit_error is not None:
            error = f"committing checkpoint step {step} failed: {self._commit_error}"
        agree_save(self, step, str(writer.path), error, writer.errno or self.commit_full)

    def _hash_own_files(self, tmp: str) -> tuple[dict[str, str], float]:
        """After a synchronous save, every rank hashes the data files it wrote itself (DCP names
        them __<rank>_<i>.distcp), in parallel and from its own page cache; rank 0 receives all
        (the gather is collective: every rank calls). Rank 0's commit hashes whatever is left
        (.metadata; everything, should DCP ever name files otherwise). Returns the hashes and
        the slowest rank's hashing seconds."""
        t0 = time.perf_counter()
        own = re.compile(rf"^__{self.rt.rank}_\d+\.distcp$")
        mine: dict[str, str] | str = {}
        try:
            mine = {n: file_sha256(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp)) if own.match(n)}
        except OSError as e:
            mine = f"rank {self.rt.rank}: hashing its checkpoint files in {tmp} failed: {e}"
        gathered = self._all_gather((mine, time.perf_counter() - t0))
        self._agree(next((m for m, _ in gathered if isinstance(m, str)), None))
        return {k: v for m, _ in gathered for k, v in m.items()}, max(s for _, s in gathered)

    def _commit(self, tmp: str, final: str, manifest: dict[str, Any], t0: float,
                hashes: dict[str, str] | None = None, hash_s: float = 0.0) -> str | None:
        """Rank 0, after every rank's data is written: manifest last, then the atomic rename.

        [Note: atomicity] Until the rename the checkpoint exists only as step_N.tmp, which no
        reader accepts. The manifest is written (and fsynced) inside tmp after DCP's .metadata,
        which DCP writes only once all ranks finished; it lists every file with its size. So a
        crash at any moment leaves either no step_N or a complete one, and a directory that a
        non-atomic rename (object stores) or a deletion left half-there fails the size check.
        The SHA-256 of every file goes in the manifest too (checked on load). Old checkpoints
        are pruned only after the new one is in place.
        """
        try:
            if not os.path.exists(os.path.join(tmp, DCP_METADATA)):
                return f"checkpoint {tmp}: DCP wrote no {DCP_METADATA}; not committed"
            manifest = dict(manifest)
            names = sorted(os.listdir(tmp))
            manifest["files"] = {n: os.path.getsize(os.path.join(tmp, n)) for n in names}
            t_hash = time.perf_counter()
            hashes = hashes or {}
            manifest[HASH_KEY] = {n: hashes.get(n) or file_sha256(os.path.join(tmp, n)) for n in names}
            manifest["hash_seconds"] = hash_s + time.perf_counter() - t_hash
            manifest["save_seconds"] = time.perf_counter() - t0
            write_json_atomic(os.path.join(tmp, MANIFEST), manifest)
            _fsync_dir(tmp)
            if os.path.exists(final):
                remove_tree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self.last_save_seconds = manifest["save_seconds"]
            self._prune(manifest["step"])
        except OSError as e:
            self.commit_full = disk_full_errno(e)  # ENOSPC, EDQUOT: the save's agreement says so (space.py)
            return f"committing checkpoint {final} failed: {e}"
        return None

    def _prune(self, newest: int) -> None:
        complete = list_checkpoints(self.root)
        for _, path in complete[:-self.keep_last]:
            remove_tree(path)
        for name in os.listdir(self.root):  # saves torn by earlier crashes
            m = re.match(r"^step_(\d{8,})\.tmp$", name)
            if m and int(m.group(1)) < newest:
                remove_tree(os.path.join(self.root, name))

    # -- load -------------------------------------------------------------------------------------
    def _hash_error(self, path: str, manifest: dict[str, Any]) -> str | None:
        """Every rank hashes a share of the files (the whole checkpoint is read once, in parallel);
        the result goes through _agree, so all ranks stop together on a mismatch."""
        names = sorted(manifest.get("files", {}))[self.rt.rank::self.rt.world_size]
        try:
            check_file_hashes(path, manifest, names)
        except CheckpointError as e:
            return str(e)
        except OSError as e:
            return f"rank {self.rt.rank}: cannot read checkpoint {path} to verify it ({e})"
        return None

    def load(self, path: str, model: nn.Module, opt, sched, state) -> dict[str, Any]:
        """Restore everything from checkpoint `path` (a step dir, checkpoints dir or run dir)
        into this engine at this world size; every rank calls it. Three parts: resolve (find,
        verify and check the checkpoint against this model, all ranks agreeing), plan (what
        this rank reads into which tensor) and apply (optimizer, schedule, train state, RNG)."""
        self.wait()
        path, manifest, reader, md = self._resolve_for_load(path, model, opt)
        reads = plan_reads(model, opt, manifest, md, self.rt.rank)
        try:
            with torch.no_grad():
                dcp_load(reads.plain, reader, _FlatPieceLoadPlanner(reads.pieces), no_dist=not _dist_ready())
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"rank {self.rt.rank}: loading checkpoint {path} failed: {e}") from e
        self._apply(path, manifest, reads, opt, sched, state)
        return manifest

    def _resolve_for_load(self, path: str, model: nn.Module, opt) -> tuple[str, dict[str, Any], SafeReader, Any]:
        """The checkpoint directory, its verified manifest, a safe reader and its DCP metadata;
        any rank's problem stops every rank with the same error."""
        error, found = None, None
        if self.rt.rank == 0:
            try:
                found = resolve_checkpoint(path)
            except CheckpointError as e:
                error = str(e)
        self._agree(error)
        path = self._broadcast(found)
        manifest = None
        try:
            manifest = verify_checkpoint(path)
        except CheckpointError as e:
            error = (f"rank {self.rt.rank} cannot read {path} ({e}): the checkpoint directory must be on a "
                     "filesystem every node shares (NFS, Lustre, a GCS FUSE mount)")
        self._agree(error)
        self._agree(self._hash_error(path, manifest))
        shapes = self._param_shapes(checkpoint_layout(model))
        self._agree(compatibility_error(path, manifest, shapes, _model_buffers(model), opt))
        reader = SafeReader(path, manifest)
        md = None
        try:
            md = reader.read_metadata().state_dict_metadata
        except CheckpointError as e:
            error = str(e)
        self._agree(error)
        return path, manifest, reader, md

    def _apply(self, path: str, manifest: dict[str, Any], reads: Reads, opt, sched, state) -> None:
        if reads.has_optim:
            for p, st in reads.optimizer_state.items():
                opt.state[p] = st
        om = manifest["optimizer"]
        if opt is not None and om is not None:
            restore_param_groups(opt, om["param_groups"], path)
        if sched is not None and manifest.get("scheduler"):
            sched.load_state_dict(manifest["scheduler"])
            if opt is not None:  # LambdaLR.load_state_dict leaves the optimizer's lr alone
                for g, lr in zip(opt.param_groups, sched.get_last_lr()):
                    g["lr"] = lr
        if state is not None:
            for key, value in manifest["train_state"].items():  # older manifests lack newer fields
                setattr(state, key, value)
        if reads.rng_keys:
            restore_rng(self.rt.rank, reads.plain)
        elif self.rt.rank == 0 or self.rt.rank >= manifest["rng_world_size"]:
            log.warning("checkpoint %s has no RNG state for rank %d (saved at world size %d): this rank keeps "
                        "its seeded RNG", path, self.rt.rank, manifest["rng_world_size"])
        self.last_saved_step = manifest["step"]
        if self.rt.rank == 0:
            log.info("resumed from %s (step %d, saved by %s at world size %d)", path, manifest["step"],
                     manifest["strategy"], manifest["world_size"])


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False
