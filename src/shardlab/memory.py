"""Live memory per rank: the bytes of live tensors over training steps, attributed to parts
(parameters, gathered parameters, gradients, optimizer state, activations, communication
buffers) and phases (forward, backward, optimizer), with the breakdown *at the peak*.

Two sources, one report (`LiveMemoryTracker.summary()`, docs/memory.md):

- Tensor storages, on any device. A `TorchDispatchMode` sees every tensor an operator
  returns while a step is tracked; each new storage gets a record (its bytes, its part) and a
  weakref whose callback subtracts it when the storage dies. `UntypedStorage.resize_`, which
  the sharded engines use to free and refill gathered buffers and which does not dispatch,
  is wrapped (how storages are seen: shardlab/memory_watch.py). Storages made before tracking
  (parameters, optimizer state, engine buffers) are adopted from what the engine and the
  optimizer expose.
- On CUDA also the caching allocator: `max_memory_allocated` / `max_memory_reserved`, read
  and reset at every phase boundary, so each phase has its own allocator peak.

On CPU `peak_live_bytes` is the storage peak and its parts sum to it exactly. On CUDA it is
the allocator's peak over the tracked steps; the storage breakdown at the storage peak is
reported beside it, with the difference (allocations no operator returned: library
workspaces, communicator buffers, block rounding) as the part "unattributed".

Why not torch's `torch.distributed._tools.mem_tracker.MemTracker` (evaluated on gpt-mini at
N=2, docs/memory.md): it labels a storage once, by the phase it was born in, so gathered
parameters, unsharded gradients and activations all land in "Activation"/"Temp"; storages
resized from zero that it did not see born (fsdp's gathered buffers) are invisible to it;
gradients our engines assign outside autograd are not "Gradient"; it refuses a second
iteration without a reset; and it updates every module's peak on every operator (+42-77 %
step time there). Here parts come from what the engines hold, which is what the question
"where is fsdp's extra memory" needs.

[Note: the breakdown at the peak, cheaply]
Classifying every live storage at every new peak would cost O(live storages) per operator.
Instead each record carries a part that changes only when something claims it, and running
totals per part are kept. A new peak only sets a flag; the *first decrease after it* (a
storage freed or shrunk) settles it first: it asks the engine, the optimizer and the
parameters' `.grad` what each storage is now (`_settle`), then copies the per-part totals.
Between a peak and the next decrease nothing was freed, and any allocation would have been a
new peak, so the storages settled are exactly those live at the peak.

[Note: a gradient is a gradient from birth]
The peak of a step is typically the moment autograd has just computed a gradient that no
one holds yet: AccumulateGrad stores it in `.grad` (and fsdp moves a unit's full gradient to
its pending reduce-scatters) only after the operator that made it returned, often after the
settle. So gradient hooks on the autograd leaves (local parameters; fsdp's gathered flat
buffers; zero3's gathered tensors; FSDP2's unsharded parameters) claim each gradient the
moment autograd delivers it, and a claim of a storage that was live and unclaimed at the
peak moves its bytes in the peak's breakdown too (`_peak_pending`): the breakdown says what
each byte at the peak *was for*, not what it had been named yet.

Limits: allocations made inside an operator and freed before it returns (kernel scratch),
inside the communication library (gloo's and NCCL's own buffers) or by C++ code outside the
dispatcher are not seen on CPU. Storages created between tracked steps (evaluation,
checkpointing) and kept are not counted unless an engine or the optimizer exposes them.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shardlab import doctor
from shardlab.memory_watch import StorageRecord, Watch, storage_of, unwatch_resizes, watch_resizes

#: Every part a byte can be attributed to, in report order.
PARTS = ("params", "gathered_params", "grads", "unsharded_grads", "optimizer", "activations", "comm", "other")
#: The phases `train_step` marks; bytes allocated outside them belong to the phase "other".
PHASES = ("forward", "backward", "optimizer")

# Part a storage gets when born, by the phase it is born in: forward and backward make
# activations (saved tensors, activation gradients, temporaries); the rest (the input batch,
# clipping's and the optimizer's temporaries) is "other" until something claims it.
_BIRTH_PART = {"forward": "activations", "backward": "activations"}

# Later claims override earlier ones when one storage is seen in several roles (fsdp's fp32
# all-gather input *is* the shard; a zero3 owner's reduce buffer becomes its `.grad`).
# Parameters, buffers and optimizer state are pinned once claimed.
_CLAIM_ORDER = ("comm", "unsharded_grads", "gathered_params", "grads")
_PINNED = ("params", "optimizer")


class LiveMemoryTracker:
    """Per-rank live tensor bytes by part and phase over the steps it tracks.

    Use: one tracker per run; for each step `with tracker.step(index, active=...)`, and
    inside it `with tracker.phase("forward")` etc. An inactive step costs a scan of
    parameters, gradients, optimizer state and engine buffers at its end (so storages made
    then, such as PyTorch DDP's gradient buckets, are known to the next tracked step).

    engine: the shardlab engine: its local parameters and buffers (`Engine`), the transient
    buffers its `memory_buffers()` lists, by part, and the leaves its `hook_memory_tracker(self)`
    hooks (`Measurable`, engines/measuring.py);
    optimizer: its state is the part "optimizer". Both optional: without an engine, pass
    `params` (and `buffers`) to tell parameters from activations.
    """

    def __init__(self, device: torch.device | str, *, engine: Any = None, optimizer: torch.optim.Optimizer | None = None,
                 params: Iterable[torch.Tensor] | None = None, buffers: Iterable[torch.Tensor] | None = None,
                 fake: bool = False):
        self.device = torch.device(device)
        # fake=True: the step runs under FakeTensorMode (plan's fake probes); a FakeTensor's storage
        # is a meta storage of the real size, born and freed as the real one would be, so those
        # count too (beside the real ones its data pipeline makes outside the fake mode)
        self.storage_devices = (self.device.type, "meta") if fake else (self.device.type,)
        self.engine = engine
        self.optimizer = optimizer
        if engine is not None:
            params = engine.local_parameters() if params is None else params
            buffers = list(engine.unwrapped().buffers()) if buffers is None else buffers
        self.params = list({id(p): p for p in params or ()}.values())
        self.buffers = list(buffers or ())
        self._lock = threading.RLock()
        self._records: dict[int, StorageRecord] = {}   # id(storage) -> record; the weakref removes it
        self.live = 0
        self.by_part = dict.fromkeys(PARTS, 0)
        self.phase_name = "other"
        self.step_index: int | None = None
        self.tracking = False
        self._watch: Watch | None = None
        self._dirty = False
        self._unclaimed_grads: set[StorageRecord] = set()      # born in backward, not claimed yet
        self._peak_pending: dict[StorageRecord, int] = {}       # those of them live at the peak: bytes
        self._hooked: dict[int, weakref.ref] = {}        # id(leaf) -> leaf, for leaves with our hook
        self._handles: list[Any] = []
        # the result
        self.peak = 0
        self.peak_parts = dict.fromkeys(PARTS, 0)
        self.peak_phase: str | None = None
        self.peak_step: int | None = None
        self.phase_peaks: dict[str, int] = {}
        self.steps_tracked = 0
        self.step_end: dict[str, Any] | None = None
        self.inconsistencies = 0
        # CUDA allocator figures (per phase, over tracked steps)
        self.cuda = self.device.type == "cuda" and not fake
        self.alloc_phase_peaks: dict[str, int] = {}
        self.reserved_peak = 0
        self.allocator_peak_seen = 0  # max_memory_allocated over the whole run, across our resets
        watch_resizes(self)
        for p in self.params:  # see [Note: a gradient is a gradient from birth]
            self.hook_leaf(p, "grads")
        if engine is not None:
            engine.hook_memory_tracker(self)  # the leaves the engine makes (gathered parameters)

    # -- the public surface ---------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, index: int | None = None, active: bool = True) -> Iterator[None]:
        """One training step; tracked when `active`. Its end adopts gradients and optimizer state."""
        if not active:
            try:
                yield
            finally:
                self._adopt_known()
            return
        self.step_index = index
        self._adopt_known()
        self._start()
        try:
            yield
        finally:
            self._stop()
            self._adopt_known()
            self.steps_tracked += 1
            # what stays between steps (before zero_grad): parameters, gradients, optimizer state
            self.step_end = {"live_bytes": self.live, "parts": dict(self.by_part)}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a phase; also a named range in a torch.profiler trace and the rank's heartbeat."""
        previous = self.phase_name
        self._phase_boundary(name)
        try:
            with torch.profiler.record_function(f"shardlab.{name}"), doctor.phase(name):
                yield
        finally:
            self._phase_boundary(previous)

    def summary(self) -> dict[str, Any]:
        """What metrics.json reports for this rank: `peak_live_bytes` and `peak_breakdown`."""
        with self._lock:
            if self._dirty:
                self._settle()
            parts = dict(self.peak_parts)
            peak, phase = self.peak, self.peak_phase
            source = "tensor storages"
            phase_peaks = {p: self.phase_peaks[p] for p in (*PHASES, "other") if p in self.phase_peaks}
            out: dict[str, Any] = {}
            if self.cuda and self.alloc_phase_peaks:
                # The allocator sees every allocation; the storage breakdown is kept, and what
                # it does not explain is named as such rather than spread over the parts.
                phase = max(self.alloc_phase_peaks, key=self.alloc_phase_peaks.__getitem__)
                storage_peak = peak
                peak = self.alloc_phase_peaks[phase]
                parts["unattributed"] = max(0, peak - storage_peak)
                source = "cuda allocator (parts: tensor storages at their own peak)"
                out["cuda"] = {"max_allocated_by_phase": dict(self.alloc_phase_peaks),
                               "max_reserved": self.reserved_peak, "storage_peak_bytes": storage_peak}
            out.update({"peak_live_bytes": int(peak), "phase": phase, "step": self.peak_step, "parts": parts,
                        "phase_peaks": phase_peaks, "step_end": self.step_end, "steps_tracked": self.steps_tracked,
                        "source": source})
            if self.inconsistencies:
                out["inconsistencies"] = self.inconsistencies
            return out

    def close(self) -> None:
        """Remove the gradient hooks this tracker put on the model."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        unwatch_resizes(self)

    # -- start / stop ---------------------------------------------------------------------------
    def _start(self) -> None:
        if self.cuda:  # what happened before this step is not this step's peak
            self.allocator_peak_seen = max(self.allocator_peak_seen, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        self.tracking = True
        self._watch = Watch(self)
        self._watch.__enter__()

    def _stop(self) -> None:
        try:
            self._close_window(self.phase_name)
            if self._watch is not None:
                self._watch.__exit__(None, None, None)
        finally:
            self._watch = None
            self.tracking = False
            with self._lock:
                if self._dirty:
                    self._settle()
                self._unclaimed_grads.clear()

    def _phase_boundary(self, new_phase: str) -> None:
        if self.tracking:
            self._close_window(self.phase_name)
        self.phase_name = new_phase

    def _close_window(self, ended: str) -> None:
        """CUDA: the allocator's peak since the last boundary belongs to the phase ending now;
        reset it for the next phase."""
        if not (self.tracking and self.cuda):
            return
        allocated = torch.cuda.max_memory_allocated(self.device)
        self.alloc_phase_peaks[ended] = max(self.alloc_phase_peaks.get(ended, 0), allocated)
        self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved(self.device))
        self.allocator_peak_seen = max(self.allocator_peak_seen, allocated)
        torch.cuda.reset_peak_memory_stats(self.device)

    # -- bookkeeping ----------------------------------------------------------------------------
    def see(self, t: torch.Tensor, fresh: bool = True) -> None:
        """A tensor an operator returned: a new storage, or a known one that changed size
        (`fresh`: the operator makes new storages, [Note: what a tracker sees] in memory_watch.py)."""
        st = storage_of(t)
        if st is None or st.device.type not in self.storage_devices:
            return
        rec = self._records.get(id(st))
        if rec is None:
            if fresh:
                self._add(st, _BIRTH_PART.get(self.phase_name, "other"))
        elif rec.nbytes != st.nbytes():
            self._resize(rec, st.nbytes())

    def resized(self, st: torch.UntypedStorage) -> None:
        """`st.resize_` returned: a known storage changed size, or one made before tracking was refilled."""
        if st.device.type not in self.storage_devices:
            return
        rec = self._records.get(id(st))
        if rec is not None:
            self._resize(rec, st.nbytes())
        elif st.nbytes() > 0 and self.tracking:
            # made before tracking and refilled now (FSDP2's all-gather outputs after a
            # warm-up step): it counts from here, as what the phase makes until claimed
            self._add(st, _BIRTH_PART.get(self.phase_name, "other"))

    def _add(self, st: torch.UntypedStorage, part: str) -> StorageRecord:
        with self._lock:
            rec = self._records.get(id(st))
            if rec is not None:
                return rec
            rec = StorageRecord(0, part)
            key = id(st)
            records, tracker_ref = self._records, weakref.ref(self)

            def dead(_ref: weakref.ref, key: int = key, rec: StorageRecord = rec) -> None:
                tracker = tracker_ref()
                if tracker is not None and records.get(key) is rec:
                    with tracker._lock:
                        tracker._resize(rec, 0)
                        del records[key]
                        tracker._unclaimed_grads.discard(rec)
                        tracker._peak_pending.pop(rec, None)

            rec.ref = weakref.ref(st, dead)
            records[key] = rec
            if self.tracking and self.phase_name == "backward" and part == "activations":
                self._unclaimed_grads.add(rec)
            self._resize(rec, st.nbytes())
            return rec

    def _resize(self, rec: StorageRecord, nbytes: int) -> None:
        with self._lock:
            delta = nbytes - rec.nbytes
            if delta < 0 and self._dirty:
                self._settle()  # the last moment the peak's storages are all alive
            rec.nbytes = nbytes
            self.live += delta
            self.by_part[rec.part] += delta
            if delta > 0 and self.tracking:  # the peak is over tracked steps
                phase = self.phase_name
                if self.live > self.phase_peaks.get(phase, 0):
                    self.phase_peaks[phase] = self.live
                if self.live > self.peak:
                    self.peak = self.live
                    self.peak_phase = phase
                    self.peak_step = self.step_index
                    self._dirty = True

    def _claim(self, t: Any, part: str, adopt: bool = False) -> None:
        st = storage_of(t)
        if st is None or st.device.type not in self.storage_devices:
            return
        rec = self._records.get(id(st))
        if rec is None:
            if adopt:
                self._add(st, part)
            return
        if rec.part == part or rec.part in _PINNED:
            return
        self.by_part[rec.part] -= rec.nbytes
        self.by_part[part] += rec.nbytes
        self._unclaimed_grads.discard(rec)
        at_peak = self._peak_pending.pop(rec, None)
        if at_peak is not None:  # it was live and unclaimed at the peak: it counts as `part` there
            self.peak_parts[rec.part] -= at_peak
            self.peak_parts[part] += at_peak
        rec.part = part

    def _settle(self) -> None:
        """Ask what each live storage is now, then take the totals as the peak's breakdown."""
        self._claim_dynamic(adopt=False)
        if self.live != self.peak:  # cannot happen (see the Note); counted, never raised in a weakref callback
            self.inconsistencies += 1
        self.peak_parts = dict(self.by_part)
        self._peak_pending = {r: r.nbytes for r in self._unclaimed_grads}
        self._dirty = False

    def _claim_dynamic(self, adopt: bool) -> None:
        if self.phase_name == "optimizer" or adopt:  # optimizer state only appears in its step
            for t in self._optimizer_tensors():
                self._claim(t, "optimizer", adopt)
        claims = list(self.engine.memory_buffers()) if self.engine is not None else []
        for part in _CLAIM_ORDER:
            for p, t in claims:
                if p == part:
                    self._claim(t, part, adopt)
            if part == "grads":
                for p in self.params:
                    if p.grad is not None:
                        self._claim(p.grad, "grads", adopt)

    def _adopt_known(self) -> None:
        """Parameters, buffers, gradients, optimizer state and engine buffers made outside a
        tracked step (model build, untracked steps) start counting from here."""
        with self._lock:
            for rec in list(self._records.values()):  # sizes changed where nothing reported them
                st = rec.ref() if rec.ref is not None else None
                if st is not None and st.nbytes() != rec.nbytes:
                    self._resize(rec, st.nbytes())
            self._hooked = {k: r for k, r in self._hooked.items() if r() is not None}
            for t in (*self.params, *self.buffers):
                self._claim(t, "params", adopt=True)
            self._claim_dynamic(adopt=True)
            if self.engine is not None:
                self.engine.hook_memory_tracker(self)  # leaves made since (FSDP2's unsharded parameters)

    def _optimizer_tensors(self) -> Iterator[torch.Tensor]:
        if self.optimizer is None:
            return
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield v

    def hook_leaf(self, t: torch.Tensor, part: str) -> None:
        """Claim the gradient autograd accumulates into leaf `t` when it arrives."""
        if not (isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf) or self._is_hooked(t):
            return
        if getattr(t, "_local_tensor", None) is not None:
            return  # DTensor parameters get `.grad` from FSDP2, not from autograd
        tracker_ref = weakref.ref(self)

        def arrived(leaf: torch.Tensor) -> None:
            tracker = tracker_ref()
            if tracker is not None and tracker.tracking and leaf.grad is not None:
                with tracker._lock:
                    tracker._claim(leaf.grad, part)

        # Registered after the engine's own hooks: ddp has copied the gradient into its bucket
        # and it is still `.grad`. Where the engine takes `.grad` away in its hook (fsdp, zero3)
        # a pre-hook on the gradient is used instead (`hook_incoming`).
        self._handles.append(t.register_post_accumulate_grad_hook(arrived))
        self._hooked[id(t)] = weakref.ref(t)

    def hook_incoming(self, t: torch.Tensor, part: str) -> None:
        """Claim the gradient flowing into leaf `t` before AccumulateGrad (and the engine's
        post-accumulate hook, which may hand it on) sees it."""
        if not (isinstance(t, torch.Tensor) and t.requires_grad) or self._is_hooked(t):
            return
        tracker_ref = weakref.ref(self)

        def incoming(grad: torch.Tensor) -> None:
            tracker = tracker_ref()
            if tracker is not None and tracker.tracking:
                with tracker._lock:
                    tracker._claim(grad, part)

        self._handles.append(t.register_hook(incoming))
        self._hooked[id(t)] = weakref.ref(t)

    def keep_handle(self, handle: Any) -> None:
        """A hook an engine registered for this tracker (hook_memory_tracker): removed at close()."""
        self._handles.append(handle)

    def _is_hooked(self, t: torch.Tensor) -> bool:
        ref = self._hooked.get(id(t))
        return ref is not None and ref() is t


# -- marks without a tracker ---------------------------------------------------------------------
@contextlib.contextmanager
def phase_range(name: str) -> Iterator[None]:
    """A phase mark outside the tracker (none runs, or a phase it does not count: data,
    checkpoint, eval): the profiler's named range and the rank's heartbeat (shardlab.doctor)."""
    with torch.profiler.record_function(f"shardlab.{name}"), doctor.phase(name):
        yield


def module_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of a plain module (no engine), deduplicated: for trackers used outside the loop."""
    return list({id(p): p for p in model.parameters()}.values())
