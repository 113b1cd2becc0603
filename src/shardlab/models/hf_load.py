"""How a Hugging Face model built on the meta device gets its values, and how it sees packed
examples: the local safetensors files (`SafetensorsReader`), transformers' own initialisation for
everything the files do not hold (`fill_`), the proof that every buffer is derived
(`underived_buffers`), and the attention path for packed rows (`builds_packed_masks`, `fallback_route`, `packed_mask`).

[Note: every tensor after the meta device]
A model built on the meta device has no values; an engine gives the tensors it keeps storage
(`to_empty`: whatever memory held) and the model must fill all of them. `fill_` does it for the
modules an engine materializes, in two passes:
1. load: each parameter with storage from the files (or peft's LoRA init for adapters), and each
   persistent buffer the files hold; every loaded tensor, and every tensor still on the meta
   device, is marked `_is_hf_initialized`.
2. derive: transformers' own `_init_weights(module)` on every module, children first, each by
   the nearest `PreTrainedModel` above it (as transformers' `initialize_weights` dispatches), under
   `guard_torch_init_functions`. transformers' init functions (`transformers.initialization`) skip
   marked tensors, so this fills exactly the rest: non-persistent buffers (rotary `inv_freq`,
   Gemma's `embed_scale`, ...) by the family's own code, and parameters the files lack. Without
   files (random init) nothing is marked and `_init_weights` draws every parameter, under a
   generator seeded by (seed, module name): a unit materialized alone equals the same unit of a
   whole build. The marks are removed afterwards.
This is what `from_pretrained` does (it marks what it loaded and runs `initialize_weights`), with
no list of class names. A buffer that no pass fills keeps garbage; `underived_buffers` finds such
buffers before any worker starts: it gives a meta build's buffers (only) storage filled with one
value, fills them, does it again with another value, and names every buffer whose result depends
on the fill.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MARK = "_is_hf_initialized"  # transformers' init functions skip a tensor with this attribute set


# -- the local files ------------------------------------------------------------------------------
def weight_files(hf_path: str) -> dict[str, str]:
    """checkpoint key -> safetensors file, from the index of a sharded directory or the one file."""
    index = os.path.join(hf_path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(hf_path, v) for k, v in weight_map.items()}
    single = os.path.join(hf_path, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"model.hf_path {hf_path!r}: neither {INDEX_FILE} nor {SINGLE_FILE} there; "
                            "save the model with save_pretrained(..., safe_serialization=True)")


class SafetensorsReader:
    """Reads single tensors (or slices of them) from a local HF directory, keeping files open."""

    def __init__(self, hf_path: str):
        self.hf_path = hf_path
        self.files = weight_files(hf_path)
        self._open: dict[str, Any] = {}
        # model key -> the transformers converter making it from several stored tensors (models/hf_convert.py)
        self.conversions: dict[str, Any] = {}
        self.bytes_read = 0       # what was read from the files, for tests and reports
        self.elements_read = 0

    def _handle(self, path: str):
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def __contains__(self, key: str) -> bool:
        return key in self.files or key in self.conversions

    def get(self, key: str, index: Any = None) -> torch.Tensor:
        """The tensor `key`, or only `index` of it (safetensors reads just that slice); a converted
        key is made by its converter from the stored tensors."""
        if key in self.conversions:
            t = self.conversions[key].get(self)
            return t if index is None else t[index]
        f = self._handle(self.files[key])
        t = f.get_tensor(key) if index is None else f.get_slice(key)[index]
        self._count(t)
        return t

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of `key`, from the file's header (no data read)."""
        if key in self.conversions:
            return self.conversions[key].shape(self)
        return tuple(self._handle(self.files[key]).get_slice(key).get_shape())

    def read_flat_range(self, key: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of tensor `key` flattened (row-major), as a 1-D tensor, reading
        only the rows of dim 0 that cover them: see [Note: reading a flat range by rows].

        [Note: reading a flat range by rows]
        fsdp keeps a slice [lo, hi) of each unit's flat buffer (the unit's tensors flattened and
        laid end to end), so a rank holds a range of elements of each tensor it overlaps, which
        may start and end mid-row. safetensors' `get_slice(key)[a:b]` reads whole rows of dim 0
        (a row = the product of the other dims; one element for a 1-D tensor) straight from the
        memory-mapped file, and nothing else. So we read rows floor(start/row) .. ceil(end/row)
        and cut the exact elements: at most one partial row is over-read at each end, i.e. fewer
        than 2 rows per tensor per rank beyond the elements the rank holds. A scalar is read whole.
        """
        if not 0 <= start < end:
            raise ValueError(f"{key}: empty or negative element range [{start}, {end})")
        if key in self.conversions:  # only the experts the range covers ([Note: reading what transformers converts])
            return self.conversions[key].read_flat_range(self, start, end)
        shape = self.shape(key)
        numel = math.prod(shape)
        if end > numel:
            raise ValueError(f"{key}: element range [{start}, {end}) beyond its {numel} elements {shape}")
        if not shape:  # a scalar
            return self.get(key).reshape(1)
        row = numel // shape[0]
        first, last = start // row, -(-end // row)
        rows = self.get(key, slice(first, last)).reshape(-1)
        return rows[start - first * row:end - first * row]

    def _count(self, t: torch.Tensor) -> None:
        self.elements_read += t.numel()
        self.bytes_read += t.numel() * t.element_size()

    def close(self) -> None:
        self._open.clear()


def checkpoint_names(hf_model: nn.Module, reader: SafetensorsReader) -> dict[str, str]:
    """model key -> the key `reader` gives it by. transformers renames some checkpoint keys when it
    loads (its conversion mapping: GPT-NeoX's `embed_out` is the model's `lm_head`, legacy
    `gamma`/`beta`, ...) and reverts them when it saves, and its WeightConverters make some model
    tensors from several stored ones (per-expert MoE tensors): shardlab reads the files the way
    `from_pretrained` does, through the same mapping. A converted tensor's key is its model key,
    registered with the reader (models/hf_convert.py)."""
    from shardlab.models.hf_convert import conversions

    names, converted = conversions(hf_model, reader.files)
    reader.conversions = converted
    names.update({k: k for k in converted})
    return names


# -- filling the tensors (see [Note: every tensor after the meta device]) ---------------------------
def seed_for(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_owners(root: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> the PreTrainedModel whose `_init_weights` transformers applies to it: the
    nearest one at or above it (transformers' `smart_apply` switches at each sub-model)."""
    from transformers import PreTrainedModel  # deferred: see models/hf_model.py, require_transformers

    owners: dict[int, nn.Module] = {}

    def walk(m: nn.Module, owner: nn.Module | None) -> None:
        owner = m if isinstance(m, PreTrainedModel) else owner
        if id(m) in owners:
            return
        if owner is not None:
            owners[id(m)] = owner
        for child in m.children():
            walk(child, owner)

    walk(root, None)
    return owners


def mark_(t: torch.Tensor, marked: list[torch.Tensor]) -> None:
    if not getattr(t, MARK, False):
        setattr(t, MARK, True)
        marked.append(t)


@contextlib.contextmanager
def marks() -> Any:
    """A list to mark tensors into (`mark_`); every mark is removed on exit."""
    marked: list[torch.Tensor] = []
    try:
        yield marked
    finally:
        for t in marked:
            with contextlib.suppress(AttributeError):
                delattr(t, MARK)


@torch.no_grad()
def derive_(order: Iterable[nn.Module], owners: dict[int, nn.Module], module_names: dict[int, str],
            seed: int, marked: list[torch.Tensor]) -> None:
    """Pass 2: transformers' `_init_weights` on each module of `order` (children first), tensors on
    the meta device marked so nothing touches them; a generator seeded per module draws what is
    drawn."""
    from transformers import initialization  # deferred: see require_transformers

    order = list(order)
    for m in order:
        for t in [*m.parameters(recurse=False), *(b for b in m.buffers(recurse=False) if b is not None)]:
            if t.device.type == "meta":
                mark_(t, marked)
    with initialization.guard_torch_init_functions():
        for m in order:
            owner = owners.get(id(m))
            if owner is None:
                continue
            devices = [t.device for t in m.parameters(recurse=False) if t.device.type == "cuda"][:1]
            with torch.random.fork_rng(devices=devices):
                _seed_generators(seed_for(seed, module_names[id(m)]), devices)
                owner._init_weights(m)


def _seed_generators(seed: int, cuda_devices: list[torch.device]) -> None:
    """The generators a module's `_init_weights` draws from: the CPU's, and the CUDA device its
    parameters are on. Not torch.manual_seed: that also queues a seeding of every lazy accelerator
    backend, formatting the Python stack each time (0.6 ms a call at a test's depth; an HF model
    build seeds once per module, 7,649 times in the family sweep)."""
    torch.default_generator.manual_seed(seed)
    for device in cuda_devices:
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def buffer_values(root: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in root.named_buffers() if b is not None}


def underived_buffers(model: nn.Module, fill: Callable[[nn.Module], None]) -> list[str]:
    """The buffers of `model` (built on the meta device) that `fill(model)` does not produce: each
    buffer gets storage holding one value, then another, and is filled; a buffer whose result
    follows the value it started from was not derived (see the Note above)."""
    results = []
    for start in (3, 5):
        for m in model.modules():
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = torch.full(b.shape, start, dtype=b.dtype, device="cpu")
        fill(model)
        results.append(buffer_values(model))
    a, b = results
    return sorted(n for n in a if n not in b or a[n].shape != b[n].shape or not torch.equal(a[n], b[n]))


def build_problem(model: nn.Module, hf_path: str | None) -> str | None:
    """What stops shardlab from filling `model` (an HFCausalLM built on the meta device; its buffers
    are given storage here), found before any worker starts: a checkpoint layout whose
    transformers converter fails on it, or a buffer nothing derives (`underived_buffers`). None: nothing."""
    kind = type(model.hf_model).__name__
    if hf_path:
        from shardlab.models.hf_convert import conversion_problem

        reader = SafetensorsReader(hf_path)
        checkpoint_names(model.hf_model, reader)
        problem = conversion_problem(hf_path, kind, reader)
        if problem:
            return problem
    bad = underived_buffers(model, lambda m: m.shardlab_initialize_())
    if bad:
        return (f"model: {kind}'s buffer{'s' if len(bad) > 1 else ''} {', '.join(bad)} "
                f"{'are' if len(bad) > 1 else 'is'} derived by nothing after a meta-device build (not in the model's "
                "files, not set by its _init_weights), so every engine would train on whatever memory held: shardlab "
                "cannot train this model")
    return None


# -- packed rows: which attention mask (see [Note: packed sequences] in models/hf_model.py) ---------------
POSITION_IDS = "position_ids"   # transformers builds the block-causal mask from the position ids
ADDITIVE = "additive mask"      # shardlab passes a 4-D float mask: 0 allowed, the dtype's minimum not
BOOLEAN = "boolean mask"        # shardlab passes a 4-D boolean mask (True: attend)
FALLBACK_MASKS = {"eager": ADDITIVE, "sdpa": BOOLEAN}


class _Seen(Exception):
    pass


@torch.no_grad()
def builds_packed_masks(hf_model: nn.Module) -> bool:
    """Whether this model (on the meta device) hands position ids that restart to transformers'
    mask builder (`masking_utils.find_packed_sequence_indices`, reached only when the attention
    implementation has a mask function there): a forward on 4 meta tokens stops at that call."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    def seen(position_ids):
        raise _Seen

    masking_utils.find_packed_sequence_indices = seen
    try:
        with torch.device("meta"):
            ids = torch.zeros(1, 4, dtype=torch.long)
            pos = torch.tensor([[0, 1, 0, 1]])
        hf_model(input_ids=ids, position_ids=pos, use_cache=False)
    except _Seen:
        return True
    except Exception:  # a model that cannot run on the meta device: not proven
        return False
    finally:
        masking_utils.find_packed_sequence_indices = original
    return False


@torch.no_grad()
def takes_4d_masks(hf_model: nn.Module) -> bool:
    """Whether this model (on the meta device) runs with a 4-D attention mask at all: Bloom builds
    its ALiBi bias from the mask's two dimensions (`build_alibi_tensor` unpacks `attention_mask.shape`)
    and fails on one; such a family gets no fallback route, so packing is refused before workers."""
    with torch.device("meta"):
        ids = torch.zeros(1, 4, dtype=torch.long)
        pos = torch.tensor([[0, 1, 0, 1]])
        mask = packed_mask(pos, FALLBACK_MASKS.get(hf_model.config._attn_implementation, ADDITIVE), hf_model.dtype)
    try:  # the call HFCausalLM.forward makes on a packed row (OPT's learned positions need the position ids)
        hf_model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)
    except Exception:  # noqa: BLE001 - any failure: this family does not take shardlab's 4-D mask
        return False
    return True


def fallback_route(config: Any) -> str | None:
    """For a family that does not build packed masks from position ids: the 4-D mask form its
    attention implementation takes (ADDITIVE for eager, which adds the mask to the scores; BOOLEAN
    for sdpa), None for another implementation or with a sliding window (such a mask would drop it)."""
    if getattr(config, "sliding_window", None):
        return None
    return FALLBACK_MASKS.get(config._attn_implementation)


def packed_mask(pos: torch.Tensor, route: str, dtype: torch.dtype) -> torch.Tensor:
    """The [B, 1, T, T] block-diagonal causal mask of rows whose position ids restart at 0 at each
    example, in the form `route` names."""
    segment = torch.cumsum((pos == 0).to(torch.int32), dim=1)
    T = pos.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=pos.device).tril()
    allowed = ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]
    if route == BOOLEAN:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=pos.device).masked_fill(~allowed, torch.finfo(dtype).min)
