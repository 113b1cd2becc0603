"""Checkpoint layouts that transformers converts while it loads: per-expert MoE tensors fused into
the model's 3-D expert parameters (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, ...), or any other
`WeightConverter` of its conversion mapping, applied by transformers' own converter objects.

[Note: reading what transformers converts]
transformers 5 keeps a family's experts fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I]) while `save_pretrained` writes, as every Hub checkpoint does, one tensor per expert
(`experts.0.gate_proj.weight`, ...). `from_pretrained` maps one layout onto the other with the
family's entry in `conversion_mapping.py`: renamings, then at most one `WeightConverter` per key,
whose operations (`MergeModulelist`, `Concatenate`, `Chunk`, ...) build the model's tensor from
the stored ones. shardlab does not re-implement any of it. `conversions` groups the checkpoint
keys exactly as `convert_and_load_state_dict_in_model` does (the renamings, then the converter
that matches, keys in its natural order: expert 10 after expert 9) by the model key they make; a
`Conversion` then gives that converter (a copy) the stored tensors, as callables reading them
from the files, and runs its own `convert`.

What a rank reads: a whole tensor when an engine materializes one (single, ddp, zero3: a unit at
a time), and for a flat range (fsdp, torch-fsdp: `read_flat_range`) only the experts the range
covers when the converter allows it: its first operation stacks the experts along dim 0
(`MergeModulelist(dim=0)`) and every later one concatenates along another dim, so row e of the
result is made of expert e's tensors alone. The converter then runs on those experts' tensors
only and the rows are cut as for a stored tensor. Any other converter reads all of its inputs.

Shapes come from the files' headers: the converter runs once on meta tensors of the stored shapes
(no data), which also proves before any worker starts that it can convert this directory.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Conversion:
    """One model tensor made by a transformers WeightConverter from several stored tensors."""

    key: str                                   # the model key it makes (as the converter renames)
    converter: Any                             # the family's WeightConverter (a template: copied per use)
    sources: dict[str, list[str]] = field(default_factory=dict)  # source pattern -> checkpoint keys, in order

    @property
    def first(self) -> str:
        return next(iter(self.sources.values()))[0]

    def _run(self, read, rows: slice | None = None) -> torch.Tensor:
        """The converter's output for this key; `rows`: only those experts' inputs (see the Note)."""
        conv = copy.deepcopy(self.converter)
        for pattern, keys in self.sources.items():
            for k in keys[rows] if rows is not None else keys:
                conv.add_tensor(self.key, k, pattern, (lambda k=k: read(k)))
        out = conv.convert(self.key)
        if len(out) != 1:
            raise ValueError(f"{self.key}: transformers' {type(self.converter).__name__} made {sorted(out)}, not one "
                             "tensor; shardlab loads a converter's tensors one model key at a time")
        value = next(iter(out.values()))
        return value[0] if isinstance(value, list) else value

    def shape(self, reader) -> tuple[int, ...]:
        """The converted shape, from the headers only (the converter run on meta tensors)."""
        def meta(k: str) -> torch.Tensor:
            return torch.empty(reader.shape(k), device="meta")
        return tuple(self._run(meta).shape)

    def get(self, reader) -> torch.Tensor:
        return self._run(reader.get)

    def row_local(self) -> bool:
        """Whether row e of the result is made of each pattern's e-th input alone (see the Note)."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        ops = list(self.converter.operations)
        counts = {len(v) for v in self.sources.values()}
        return (bool(ops) and type(ops[0]) is MergeModulelist and ops[0].dim == 0 and len(counts) == 1
                and all(type(op) is Concatenate and op.dim not in (0, None) for op in ops[1:]))

    def read_flat_range(self, reader, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the converted tensor flattened, reading only the experts that
        cover them when `row_local`, else everything."""
        shape = self.shape(reader)
        if not self.row_local() or len(shape) < 2:
            return self._run(reader.get).reshape(-1)[start:end]
        row = math.prod(shape[1:])
        first, last = start // row, -(-end // row)
        rows = self._run(reader.get, slice(first, last)).reshape(-1)
        return rows[start - first * row:end - first * row]


def conversions(hf_model: nn.Module, keys: Iterable[str]) -> tuple[dict[str, str], dict[str, Conversion]]:
    """(model key -> checkpoint key for tensors read as stored, model key -> Conversion for tensors
    a WeightConverter makes), by transformers' own conversion mapping for this model, in the order
    `from_pretrained` takes the keys (see [Note: reading what transformers converts])."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        apply_converters,
        apply_renamings,
        dot_natural_key,
    )

    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    names: dict[str, str] = {}
    converted: dict[str, Conversion] = {}
    for key in sorted(keys, key=dot_natural_key):
        renamed = apply_renamings(key, renamings)
        target, pattern = apply_converters(renamed, converters)
        if pattern is None:
            names[renamed] = key
            continue
        conv = converted.setdefault(target, Conversion(target, by_pattern[pattern]))
        conv.sources.setdefault(pattern, []).append(key)
    for conv in converted.values():  # the converter's own source order (gate before up), as transformers keeps it
        order = conv.converter.source_patterns
        conv.sources = {p: conv.sources[p] for p in order if p in conv.sources}
    return names, converted


def conversion_problem(hf_path: str, kind: str, reader) -> str | None:
    """Why a converted tensor of this directory cannot be made (its converter fails on the stored
    shapes), found from the headers before any worker starts; None: every one can."""
    for conv in reader.conversions.values():
        try:
            conv.shape(reader)
        except Exception as e:  # noqa: BLE001 - any failure of transformers' converter is the reason
            return (f"model.hf_path {hf_path!r}: {kind} makes {conv.key} from {conv.first} (and more) through "
                    f"transformers' {type(conv.converter).__name__}, which fails on this directory's shapes: "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return None
