"""The module behind `model.name=hf` (models/hf.py: its keys, checks and registry entry): a Hugging
Face `transformers` causal LM built from local files only, optionally with LoRA adapters through `peft`.

[Note: how an engine fills a model built on the meta device]
Engines build nothing themselves: they give a meta module's tensors storage and call
`shardlab.models.init.init_parameters_(root, seed, modules, names)` for the modules they
materialize (a sharded engine: one unit at a time). When the root model defines
`shardlab_initialize_(modules, names)` that call is handed to it, so this model fills each
materialized tensor itself: from the safetensors files (only the tensors of those modules are
read, through `safe_open`, never the whole model), then transformers' own `_init_weights` for
everything else (non-persistent buffers, parameters without files: see [Note: every tensor after
the meta device] in models/hf_load.py), under a generator seeded by (seed, module name), so a
unit materialized alone equals the same unit of a whole build. Every construction (train,
verify, eval, generate, export) builds on the meta device and fills this way.
fsdp and torch-fsdp go one step further: through `shardlab_range_readers` each rank reads only the
element ranges of its flat shard (fsdp, see [Note: reading a flat range by rows] in
SafetensorsReader) or the rows of its DTensor shards (torch-fsdp, see [Note: torch-fsdp from the
meta device] in engines/native.py).

[Note: packed sequences]
A batch's inputs are either token ids [B, T], or [B, 2, T]: token ids and position ids. Position
ids restart at 0 at each packed example. The forward passes the position ids and no attention
mask: transformers builds the block-causal mask from them itself (a new sequence wherever the
position does not grow by 1), in its attention implementation's form, sliding windows included.
Whether the family does is found once, on the meta device (hf_load.builds_packed_masks). A family
that does not gets a block-diagonal 4-D mask in the form its implementation takes: additive for
eager (which adds the mask to the scores: a boolean one would be added as 0/1), boolean for sdpa;
otherwise data.packing is refused before any worker starts. Targets of -100 are ignored.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
from torch import nn

from shardlab.models.hf_head import head_scale
from shardlab.models.hf_load import (
    ADDITIVE,
    BOOLEAN,
    POSITION_IDS,
    SafetensorsReader,
    builds_packed_masks,
    checkpoint_names,
    derive_,
    fallback_route,
    init_owners,
    mark_,
    marks,
    packed_mask,
    takes_4d_masks,
)
from shardlab.models.hf_lora import _add_lora, _init_lora_, _is_lora_leaf
from shardlab.models.hf_router import float64_experts_, router_balance, router_loss, router_stats
from shardlab.models.init import materialize_
from shardlab.models.lm_loss import choose_loss, chunked_loss, full_loss

HF_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def require_transformers():
    try:  # deferred: transformers costs 0.8 s to import and is an optional extra (shardlab[hf])
        import transformers
    except ImportError as e:  # pragma: no cover - the extra is installed by make setup
        raise RuntimeError("model.name=hf needs the `transformers` package: pip install 'shardlab[hf]'") from e
    return transformers


# -- the model ------------------------------------------------------------------------------------
@dataclass
class LoRAKeys:
    """`model.lora.*`: LoRA adapters through peft; rank 0 = full fine-tuning."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Optional[list[str]] = None   # null: peft's default, else the attention (hf_lora.default_targets)


class HFCausalLM(nn.Module):
    """A transformers causal LM behind shardlab's model contract:
    forward(inputs, targets=None) -> logits, or the mean loss over targets != -100."""

    def __init__(self, hf_config: Any, *, seed: int = 0, hf_path: str | None = None,
                 dtype: torch.dtype = torch.float32, lora: dict[str, Any] | None = None,
                 attention: str | None = None):
        """attention: transformers' attn_implementation (None: its default for the family). Built on the meta device whatever the device in effect (`with torch.device(...)`), then,
        unless that device is meta, materialized there by `materialize_`: the path every engine
        takes (see [Note: every tensor after the meta device] in models/hf_load.py)."""
        super().__init__()
        transformers = require_transformers()
        self.init_seed = seed
        self.hf_path = hf_path
        self.lora = dict(lora) if lora and lora.get("rank", 0) > 0 else None
        device = torch.get_default_device()
        with torch.device("meta"):
            chosen = {"attn_implementation": attention} if attention else {}
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype, **chosen)
            # the family hands restarting position ids to transformers' mask builder ([Note: packed sequences])
            self.packs_by_position_ids = builds_packed_masks(model)
            self.takes_4d_masks = takes_4d_masks(model)  # Bloom's ALiBi does not: packing refused
            if self.lora is not None:
                for p in model.parameters():
                    p.requires_grad_(False)
                model = _add_lora(model, self.lora)
                for name, m in model.named_modules():  # adapters in the model's dtype
                    if _is_lora_leaf(name):
                        m.to(dtype)
        self.model = model
        if dtype == torch.float64:  # transformers' default experts have no float64 kernel ([Note: float64 experts])
            float64_experts_(self.hf_model)
        # the family's router loss when the config asks for it, or why it cannot be added (hf_router.py)
        self.router_fn, self.router_problem = router_loss(self.hf_model)
        self.router_groups = 1  # verify's one-process reference: its micro batch's rows in N groups
        self.router_stats = router_stats(self.hf_model)  # tokens per expert, balancing loss ([Note: router statistics])
        # the scale the family puts on lm_head's output, or why the chunked loss cannot follow it
        self.head_scale, self.head_problem = head_scale(self.hf_model)
        self.loss = "full"  # what use_loss chose (train.loss); a model built outside training keeps the full loss
        self._reader: SafetensorsReader | None = None
        self._names: dict[str, str] | None = None  # model key -> checkpoint key (see _find)
        if device.type != "meta":
            materialize_(self, device, seed)

    # the pieces the rest of shardlab asks for
    @property
    def hf_model(self) -> nn.Module:
        """The transformers model (with LoRA: the peft model's base, adapters injected)."""
        return self.model.get_base_model() if self.lora is not None else self.model

    @property
    def hf_config(self):
        return self.hf_model.config

    def wrap_classes(self) -> set[type]:
        """The decoder layers (transformers lists them in `_no_split_modules`)."""
        names = set(getattr(self.hf_model, "_no_split_modules", None) or ())
        return {type(m) for m in self.modules() if type(m).__name__ in names}

    @property
    def attention(self) -> str:
        """The attention implementation in use (transformers' `_attn_implementation`)."""
        return self.hf_config._attn_implementation

    def packed_route(self) -> str | None:
        """How packed examples are kept apart under the attention implementation in use:
        hf_load.POSITION_IDS, ADDITIVE or BOOLEAN, None when no way is known (packing refused)."""
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        if self.packs_by_position_ids and self.attention in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            return POSITION_IDS
        return fallback_route(self.hf_config) if self.takes_4d_masks else None

    def attention_record(self, packing: bool) -> dict[str, Any]:
        """What run_args.json records and the run prints once: the implementation and how packed
        examples are kept apart."""
        how = {POSITION_IDS: "transformers' masks from position ids", ADDITIVE: "shardlab's 4-D additive mask",
               BOOLEAN: "shardlab's 4-D boolean mask"}
        return {"implementation": self.attention,
                "packed_examples": how.get(self.packed_route(), "refused") if packing else None}

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if inputs.dim() == 3:  # packed: [B, 2, T] = token ids, position ids
            ids, pos = inputs[:, 0], inputs[:, 1].long()
            kwargs = {"position_ids": pos}
            route = self.packed_route()
            if route is None:
                raise ValueError(f"packed rows: no known way to keep examples apart in {self.hf_config.model_type} "
                                 f"under attention {self.attention!r}; set data.packing=false")
            if route != POSITION_IDS:
                kwargs["attention_mask"] = packed_mask(pos, route, next(self.parameters()).dtype)
        else:
            ids = inputs
        router = self.router_fn if targets is not None else None  # [Note: the router loss across micro batches and ranks]
        if router is not None:
            kwargs["output_router_logits"] = True
        stats = self.router_stats if self.training and targets is not None else None
        if stats is not None:
            stats.begin()
        if targets is not None and self.loss == "chunked":  # the decoder's last hidden state, then the head
            out = self.hf_model.get_decoder()(input_ids=ids, use_cache=False, **kwargs)
            head = self.hf_model.get_output_embeddings()
            loss = chunked_loss(out.last_hidden_state, head.weight, targets, bias=head.bias, scale=self.head_scale)
        else:
            out = self.model(input_ids=ids, use_cache=False, **kwargs)
            if targets is None:
                return out.logits
            loss = full_loss(out.logits, targets)
        if router is not None:
            balance = router_balance(self.hf_model, router, out.router_logits, targets, self.router_groups)
            loss = loss + self.hf_model.router_aux_loss_coef * balance
            if stats is not None:
                stats.add_balance(balance)
        if stats is not None:
            stats.count()
        return loss

    def use_loss(self, requested: str) -> str | None:
        """train.loss (auto | chunked | full) -> the loss forward computes; a line to print, or None."""
        vocab, width = self.hf_model.get_output_embeddings().weight.shape
        self.loss, note = choose_loss(requested, vocab, width, self.head_problem)
        return note

    # -- filling tensors (see the Note at the top) ----------------------------------------------
    def checkpoint_key(self, canonical: str) -> str:
        """Our parameter name -> its key in a transformers checkpoint."""
        key = canonical.removeprefix("model.")
        if self.lora is not None:
            # peft nests one wrapper per adapted parameter of a module (MoE experts: gate_up_proj and down_proj)
            key = re.sub(r"(\.base_layer)+\.", ".", key.removeprefix("base_model.model."))
        return key

    def _find(self, reader: SafetensorsReader, key: str, alternatives: list[str]) -> str | None:
        """The checkpoint key of model key `key` (or of one of `alternatives`), through transformers'
        renaming and converters of checkpoint keys (hf_load.checkpoint_names), with or without the base prefix."""
        if self._names is None:
            self._names = checkpoint_names(self.hf_model, reader)
        prefix = getattr(self.hf_model, "base_model_prefix", "") + "."
        for k in [key, *alternatives]:
            for cand in (k, k.removeprefix(prefix), prefix + k):
                if cand in self._names:
                    return self._names[cand]
        return None

    def _file_key(self, reader: SafetensorsReader, canonical: str, tied_names: list[str]) -> str:
        """The checkpoint key holding parameter `canonical` (or one of the names it is tied to)."""
        key = self._find(reader, self.checkpoint_key(canonical), [self.checkpoint_key(n) for n in tied_names])
        if key is None:
            raise KeyError(f"model.hf_path {self.hf_path!r} has no weight for {self.checkpoint_key(canonical)!r}; "
                           "the directory does not match its config.json")
        return key

    def _check_shape(self, key: str, stored: tuple[int, ...], p: torch.Tensor) -> None:
        if tuple(stored) != tuple(p.shape):
            raise ValueError(f"model.hf_path: {key} has shape {tuple(stored)}, the config says {tuple(p.shape)}")

    def shardlab_range_readers(self, params: list[torch.Tensor], names: dict[int, str]) -> dict[int, Any]:
        """For an engine that keeps a flat range of each parameter (fsdp): id(p) -> read(start, end),
        the elements [start, end) of p flattened, read from model.hf_path's files alone (see
        SafetensorsReader.read_flat_range), for every p of `params` that comes from the files.
        Parameters not in the result (random init, LoRA adapters) are materialized and filled by
        `shardlab_initialize_` as usual. Keys and shapes are checked here, before any read."""
        if not self.hf_path:
            return {}
        reader = self._open_reader()
        tied: dict[int, list[str]] = {}
        for n, p in self.named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(n)
        out: dict[int, Any] = {}
        for p in params:
            canonical = names[id(p)]
            if ".lora_" in canonical:
                continue
            key = self._file_key(reader, canonical, tied.get(id(p), [canonical]))
            self._check_shape(key, reader.shape(key), p)
            out[id(p)] = functools.partial(reader.read_flat_range, key)
        return out

    @torch.no_grad()
    def shardlab_initialize_(self, modules=None, names: dict[int, str] | None = None) -> None:
        """Fill the parameters and buffers of `modules` (all when None) that have storage: from
        model.hf_path, then transformers' own `_init_weights` for the rest (see [Note: every tensor
        after the meta device] in models/hf_load.py). Called by shardlab.models.init.init_parameters_,
        i.e. by every engine's materialization."""
        tied: dict[int, list[str]] = {}
        for n, p in self.named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(n)
        names = names if names is not None else {id(p): n for n, p in self.named_parameters()}
        module_names = {id(m): n for n, m in self.named_modules(remove_duplicate=False)}
        wanted = None if modules is None else {id(m) for m in modules}
        # children before parents (as transformers' own initialize_weights): a parent's init
        # (GPT-2 attention scaling its c_proj) has the last word, as in a whole build
        order = [m for m in self.modules() if wanted is None or id(m) in wanted][::-1]
        reader = self._open_reader() if self.hf_path else None
        with marks() as marked:
            for m in order:
                self._load_module_(m, module_names[id(m)], reader, names, tied, marked)
            derive_(order, init_owners(self), module_names, self.init_seed, marked)

    @torch.no_grad()
    def load_state_(self, state: dict[str, torch.Tensor]) -> None:
        """A meta build given `state` (a checkpoint's: parameters and persistent buffers, assigned
        as they are), and everything else derived as after any materialization: the non-persistent
        buffers by transformers' own `_init_weights`, never from the files."""
        self.load_state_dict(state, strict=True, assign=True)
        for m in self.modules():
            for name, b in list(m._buffers.items()):
                if b is not None and b.device.type == "meta":
                    m._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
        module_names = {id(m): n for n, m in self.named_modules(remove_duplicate=False)}
        with marks() as marked:
            for t in self.state_dict(keep_vars=True).values():  # what `state` gave: parameters, persistent buffers
                mark_(t, marked)
            derive_(list(self.modules())[::-1], init_owners(self), module_names, self.init_seed, marked)

    def _load_module_(self, m: nn.Module, module_name: str, reader: SafetensorsReader | None,
                      names: dict[int, str], tied: dict[int, list[str]], marked: list[torch.Tensor]) -> None:
        """Pass 1 for one module: its parameters with storage from the files (LoRA adapters: peft's
        init) and its persistent buffers the files hold, each marked as filled."""
        for local, p in m.named_parameters(recurse=False):
            if p.device.type == "meta":
                continue
            canonical = names.get(id(p)) or tied.get(id(p), [f"{module_name}.{local}"])[0]
            if ".lora_" in canonical:
                _init_lora_(p, canonical, self.init_seed)
            elif reader is not None:
                key = self._file_key(reader, canonical, tied.get(id(p), [canonical]))
                value = reader.get(key)
                self._check_shape(key, value.shape, p)
                p.copy_(value.to(dtype=p.dtype))
            else:
                continue
            mark_(p, marked)
        if reader is None:
            return
        for bname, b in m._buffers.items():
            if b is None or b.device.type == "meta" or bname in m._non_persistent_buffers_set:
                continue
            key = self._find(reader, self.checkpoint_key(f"{module_name}.{bname}"), [])
            if key is not None:
                value = reader.get(key)
                self._check_shape(key, value.shape, b)
                b.copy_(value.to(dtype=b.dtype))
                mark_(b, marked)

    def _open_reader(self) -> SafetensorsReader:
        if self._reader is None:
            self._reader = SafetensorsReader(self.hf_path)
        return self._reader


# -- reading the config and building (every command builds here) ----------------------------------
def config_file(section) -> str:
    """The config JSON: model.hf_path's config.json, or model.hf_config (a file, a directory with
    config.json, or the name of a shipped one: shardlab/configs/hf/, e.g. mistral-tiny)."""
    from shardlab.shipped import hf_config_path

    path = section.hf_path or hf_config_path(section.hf_config) or section.hf_config
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def load_hf_config(section, vocab_size: int | None = None):
    transformers = require_transformers()
    with open(config_file(section)) as f:
        raw = json.load(f)
    config = transformers.AutoConfig.for_model(**raw)
    if vocab_size is not None and section.hf_path is None and vocab_size > config.vocab_size:
        config.vocab_size = vocab_size  # random init: room for the data's tokenizer
    return config


def build_hf(section, seed: int, vocab_size: int | None) -> HFCausalLM:
    """The one construction of an hf model (train, verify, eval, generate, export all come here or
    through models/hf.py's `_rebuild` of what `_record` kept)."""
    config = load_hf_config(section, vocab_size)
    return HFCausalLM(config, seed=seed, hf_path=section.hf_path, dtype=HF_DTYPES[section.hf_dtype],
                      lora=asdict(section.lora), attention=getattr(section, "hf_attention", None))
