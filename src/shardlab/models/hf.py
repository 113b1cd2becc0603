"""`model.name=hf`: a Hugging Face `transformers` causal LM (Mistral, Llama, Qwen2, GPT-2, ...)
built from local files only, optionally with LoRA adapters through `peft`.

    model.hf_path     a local directory: config.json and safetensors weights (one file, or
                      sharded with model.safetensors.index.json)
    model.hf_config   a config JSON only: random init with the model's own `_init_weights`
    model.hf_dtype    the parameters' (master weights') dtype: fp32 | bf16 | fp64
    model.lora.*      rank > 0 adds LoRA adapters; the base weights are frozen

[Note: how an engine fills a model built on the meta device]
Engines build nothing themselves: they give a meta module's tensors storage and call
`shardlab.models.init.init_parameters_(root, seed, modules, names)` for the modules they
materialize (a sharded engine: one unit at a time). When the root model defines
`shardlab_initialize_(modules, names)` that call is handed to it, so this model fills each
materialized tensor itself: from the safetensors files (only the tensors of those modules are
read, through `safe_open`, never the whole model), or by the model's own `_init_weights`
under a generator seeded by (seed, module name), so a unit materialized alone equals the same
unit of a whole build. Non-persistent buffers (rotary `inv_freq`) are not in any file and a
meta build left them meta; they are recomputed here from the config on the real device.
fsdp and torch-fsdp go one step further: through `shardlab_range_readers` each rank reads only the
element ranges of its flat shard (fsdp, see [Note: reading a flat range by rows] in
SafetensorsReader) or the rows of its DTensor shards (torch-fsdp, see [Note: torch-fsdp from the
meta device] in engines/native.py).

[Note: packed sequences]
A batch's inputs are either token ids [B, T], or [B, 2, T]: token ids and position ids. Position
ids restart at 0 at each packed example, so the examples are the runs between zeros; the
forward turns them into a block-diagonal causal mask (4-D boolean, which transformers' sdpa
and eager attention honour) so attention never crosses examples. Targets of -100 are ignored.
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from shardlab.errors import ConfigError
from shardlab.models.init import init_parameters_
from shardlab.models.safetensors_check import check_safetensors_dir
from shardlab.models.spec import ModelSpec

IGNORE_INDEX = -100
HF_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def require_transformers():
    try:  # deferred: transformers costs 0.8 s to import and is an optional extra (shardlab[hf])
        import transformers
    except ImportError as e:  # pragma: no cover - the extra is installed by make setup
        raise RuntimeError("model.name=hf needs the `transformers` package: pip install 'shardlab[hf]'") from e
    return transformers


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
        self.bytes_read = 0       # what was read from the files, for tests and reports
        self.elements_read = 0

    def _handle(self, path: str):
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def get(self, key: str, index: Any = None) -> torch.Tensor:
        """The tensor `key`, or only `index` of it (safetensors reads just that slice)."""
        f = self._handle(self.files[key])
        t = f.get_tensor(key) if index is None else f.get_slice(key)[index]
        self._count(t)
        return t

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of `key`, from the file's header (no data read)."""
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


# -- the model ------------------------------------------------------------------------------------
@dataclass
class LoRAKeys:
    """`model.lora.*`: LoRA adapters through peft; rank 0 = full fine-tuning."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Optional[list[str]] = None   # null: peft's default for the architecture


def _seed_for(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


class HFCausalLM(nn.Module):
    """A transformers causal LM behind shardlab's model contract:
    forward(inputs, targets=None) -> logits, or the mean loss over targets != -100."""

    def __init__(self, hf_config: Any, *, seed: int = 0, hf_path: str | None = None,
                 dtype: torch.dtype = torch.float32, lora: dict[str, Any] | None = None):
        super().__init__()
        transformers = require_transformers()
        self.init_seed = seed
        self.hf_path = hf_path
        self.lora = dict(lora) if lora and lora.get("rank", 0) > 0 else None
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        if self.lora is not None:
            for p in model.parameters():
                p.requires_grad_(False)
            model = _add_lora(model, self.lora)
            for name, m in model.named_modules():  # adapters in the model's dtype, on meta too
                if _is_lora_leaf(name):
                    m.to(dtype)
        self.model = model
        self._reader: SafetensorsReader | None = None
        if not any(t.device.type == "meta" for t in self.parameters()):
            init_parameters_(self, seed)

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

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if inputs.dim() == 3:  # packed: [B, 2, T] = token ids, position ids
            ids, pos = inputs[:, 0], inputs[:, 1]
            segment = torch.cumsum((pos == 0).to(torch.int32), dim=1)
            T = ids.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
            mask = (segment[:, :, None] == segment[:, None, :]) & causal
            kwargs = {"position_ids": pos, "attention_mask": mask[:, None]}
        else:
            ids = inputs
        logits = self.model(input_ids=ids, use_cache=False, **kwargs).logits
        if targets is None:
            return logits
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX)

    # -- filling tensors (see the Note at the top) ----------------------------------------------
    def checkpoint_key(self, canonical: str) -> str:
        """Our parameter name -> its key in a transformers checkpoint."""
        key = canonical.removeprefix("model.")
        if self.lora is not None:
            key = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        return key

    def _find(self, reader: SafetensorsReader, key: str, alternatives: list[str]) -> str | None:
        prefix = getattr(self.hf_model, "base_model_prefix", "") + "."
        for k in [key, *alternatives]:
            for cand in (k, k.removeprefix(prefix), prefix + k):
                if cand in reader:
                    return cand
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
        model.hf_path, or by random init; recompute non-persistent buffers. Called by
        shardlab.models.init.init_parameters_, i.e. by every engine's materialization."""
        all_names = {id(p): n for n, p in self.named_parameters(remove_duplicate=False)}
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
        hf = self.hf_model
        for m in order:
            params = [(ln, p) for ln, p in m.named_parameters(recurse=False) if p.device.type != "meta"]
            if reader is None and params and not _is_lora_leaf(module_names[id(m)]):
                with torch.random.fork_rng(devices=_rng_devices(params[0][1])):
                    torch.manual_seed(_seed_for(self.init_seed, module_names[id(m)]))
                    hf._init_weights(m)
            for _local, p in params:
                canonical = names.get(id(p)) or all_names[id(p)]
                if ".lora_" in canonical:
                    _init_lora_(p, canonical, self.init_seed)
                elif reader is not None:
                    key = self._file_key(reader, canonical, tied[id(p)])
                    value = reader.get(key)
                    self._check_shape(key, value.shape, p)
                    p.copy_(value.to(dtype=p.dtype))
            recompute_buffers_(m)

    def _open_reader(self) -> SafetensorsReader:
        if self._reader is None:
            self._reader = SafetensorsReader(self.hf_path)
        return self._reader


def _rng_devices(t: torch.Tensor) -> list:
    return [t.device] if t.device.type == "cuda" else []


def _is_lora_leaf(module_name: str) -> bool:
    return ".lora_" in module_name


def _init_lora_(p: torch.Tensor, name: str, seed: int) -> None:
    """peft's default LoRA init (A: Kaiming uniform, B: zeros), drawn on CPU from (seed, name)."""
    if ".lora_B" in name:
        p.zero_()
        return
    g = torch.Generator().manual_seed(_seed_for(seed, name))
    value = torch.empty(p.shape, dtype=torch.float64)
    bound = (1.0 / p.shape[1]) ** 0.5  # kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    value.uniform_(-bound, bound, generator=g)
    p.copy_(value.to(p.dtype))


@torch.no_grad()
def recompute_buffers_(m: nn.Module) -> None:
    """Non-persistent buffers computed at construction: rotary inverse frequencies."""
    if "RotaryEmbedding" in type(m).__name__ and hasattr(m, "inv_freq") and m.inv_freq.device.type != "meta":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # deferred: see require_transformers

        fns = {"default": getattr(m, "compute_default_rope_parameters", None), **ROPE_INIT_FUNCTIONS}
        inv_freq, scaling = fns[m.rope_type](m.config)
        m.inv_freq.copy_(inv_freq.to(m.inv_freq.device))
        if hasattr(m, "original_inv_freq"):
            m.original_inv_freq.copy_(inv_freq.to(m.inv_freq.device))
        m.attention_scaling = scaling


def _add_lora(model: nn.Module, lora: dict[str, Any]) -> nn.Module:
    try:  # deferred: peft costs 3 s to import and is an optional extra (shardlab[hf])
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover
        raise RuntimeError("model.lora needs the `peft` package: pip install 'shardlab[hf]'") from e
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=lora.get("target_modules"), task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # peft's PeftModel.__init__ reads transformers' deprecated `is_gradient_checkpointing`
        # (FutureWarning, transformers 5): that one warning of that one call, nothing else
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return get_peft_model(model, config)


# -- registry entry (shardlab.models.MODELS) -------------------------------------------------------
@dataclass
class HFKeys:
    """`model.*` keys of model.name=hf."""

    hf_path: Optional[str] = None          # local HF directory: config.json + safetensors
    hf_config: Optional[str] = None        # a config JSON (or a directory with config.json): random init
    hf_dtype: str = "fp32"                 # parameter dtype: fp32 | bf16 | fp64
    lora: LoRAKeys = field(default_factory=LoRAKeys)


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


def _check(section) -> None:
    if section.name != "hf":
        return
    if (section.hf_path is None) == (section.hf_config is None):
        raise ConfigError("model.name=hf needs exactly one of model.hf_path (a local HF directory with config.json "
                          "and safetensors weights) or model.hf_config (a config JSON, random init)")
    if section.hf_path is not None:
        if not os.path.isfile(os.path.join(section.hf_path, "config.json")):
            raise ConfigError(f"model.hf_path {section.hf_path!r}: no config.json there; point it at a local "
                              "directory written by save_pretrained (nothing is downloaded)")
        if not any(os.path.isfile(os.path.join(section.hf_path, f)) for f in (INDEX_FILE, SINGLE_FILE)):
            raise ConfigError(f"model.hf_path {section.hf_path!r}: no {SINGLE_FILE} or {INDEX_FILE}; save the model "
                              "in safetensors (save_pretrained(..., safe_serialization=True))")
        check_safetensors_dir(section.hf_path)  # headers only: a corrupted file is named before any worker
    elif not os.path.isfile(config_file(section)):
        from shardlab.shipped import shipped_hf_configs

        raise ConfigError(f"model.hf_config {section.hf_config!r}: no such file; give a config JSON, a directory "
                          f"with config.json, or a shipped one's name ({', '.join(shipped_hf_configs())})")
    try:
        with open(config_file(section)) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file(section)}:{e.lineno}: not valid JSON ({e.msg})") from None
    if "model_type" not in raw:
        raise ConfigError(f"{config_file(section)}: no \"model_type\" (e.g. \"mistral\", \"llama\", \"gpt2\"); "
                          "transformers needs it to pick the architecture")
    if section.hf_dtype not in HF_DTYPES:
        raise ConfigError(f"model.hf_dtype: unknown value {section.hf_dtype!r}; valid: {', '.join(HF_DTYPES)}")
    lo = section.lora
    if lo.rank < 0:
        raise ConfigError(f"model.lora.rank must be >= 0 (0 = full fine-tuning), got {lo.rank}")
    if lo.rank and (lo.alpha <= 0 or not 0 <= lo.dropout < 1):
        raise ConfigError("model.lora.alpha must be > 0 and model.lora.dropout in [0, 1)")
    if lo.rank:
        problem = lora_target_problem(section, raw["model_type"])
        if problem:
            raise ConfigError(problem)


def lora_layer_names(section) -> dict[str, list[str]]:
    """Last name component -> full names of the modules LoRA can adapt (Linear, GPT-2's Conv1D,
    Embedding, Conv*d), from the architecture built on the meta device (no memory, no weights)."""
    transformers = require_transformers()
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(load_hf_config(section))
    kinds = (nn.Linear, Conv1D, nn.Embedding, nn.Conv1d, nn.Conv2d)
    out: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        if name and isinstance(m, kinds):
            out.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return out


def lora_target_problem(section, model_type: str) -> str | None:
    """What is wrong with model.lora.target_modules for this architecture (None: nothing), found
    before any worker starts; peft would fail with a traceback, or silently skip a bad name."""
    targets = section.lora.target_modules
    if targets is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        if model_type in defaults:
            return None
    names = lora_layer_names(section)
    linear = sorted(names)
    if targets is None:
        return (f"model.lora.target_modules=null: peft has no default LoRA targets for model_type {model_type!r}; "
                f"name them, e.g. model.lora.target_modules=[{', '.join(linear[:2])}] (the layers LoRA can adapt in "
                f"this model: {', '.join(linear)})")
    full = {n for group in names.values() for n in group}
    unknown = [t for t in targets if t not in names and t not in full
               and not any(n.endswith("." + t) for n in full)]
    if unknown:
        return (f"model.lora.target_modules: {unknown} match{'es' if len(unknown) == 1 else ''} no layer of this "
                f"{model_type} model that LoRA can adapt; its Linear (and Conv1D, Embedding) layers: "
                f"{', '.join(linear)}")
    return None


def _build(section, seed: int, vocab_size: int | None) -> HFCausalLM:
    config = load_hf_config(section, vocab_size)
    return HFCausalLM(config, seed=seed, hf_path=section.hf_path, dtype=HF_DTYPES[section.hf_dtype],
                      lora=asdict(section.lora))


def _record(model: HFCausalLM) -> dict[str, Any]:
    dtype = {v: k for k, v in HF_DTYPES.items()}[next(model.parameters()).dtype]
    return {"hf_config": model.hf_config.to_dict(), "dtype": dtype, "lora": model.lora,
            "hf_path": model.hf_path}


def _rebuild(kwargs: dict[str, Any], seed: int) -> HFCausalLM:
    """The architecture, randomly initialized (the checkpoint's state_dict is loaded next)."""
    transformers = require_transformers()
    raw = dict(kwargs["hf_config"])
    config = transformers.AutoConfig.for_model(**raw)
    return HFCausalLM(config, seed=seed, dtype=HF_DTYPES[kwargs.get("dtype", "fp32")], lora=kwargs.get("lora"))


def _max_seq_len(section) -> int | None:
    if section.name != "hf" or not (section.hf_path or section.hf_config):
        return None
    try:
        with open(config_file(section)) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return raw.get("max_position_embeddings") or raw.get("n_positions")


def _cut_depth(raw: dict[str, Any], n_layer: int, tmpdir: str) -> None:
    """A copy of the section's config with num_hidden_layers=n_layer written into tmpdir and used
    as model.hf_config (random init: a plan probe measures memory, which the values do not
    change); per-layer lists such as layer_types are cut to match."""
    config = load_hf_config(SimpleNamespace(hf_path=raw.get("hf_path"), hf_config=raw.get("hf_config")))
    config.num_hidden_layers = n_layer
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:n_layer]
    path = os.path.join(tmpdir, f"hf-config-{n_layer}-layers.json")
    # written whole, then renamed: ranks that cut the same config into one directory (verify's
    # workers) never read another's half-written file
    partial = f"{path}.tmp-{os.getpid()}"
    config.to_json_file(partial)
    os.replace(partial, path)
    raw.update(hf_path=None, hf_config=path)


def hf_vocab_size(section) -> int | None:
    try:
        with open(config_file(section)) as f:
            return json.load(f).get("vocab_size")
    except (OSError, TypeError, json.JSONDecodeError):
        return None


SPEC = ModelSpec(
    name="hf", keys=HFKeys, data_kind="tokens",
    build=_build, record=_record, rebuild=_rebuild, check=_check,
    synthetic=lambda section: {"vocab_size": hf_vocab_size(section) or 256},
    max_seq_len=_max_seq_len,
    depth=lambda section: load_hf_config(section).num_hidden_layers,
    cut_depth=_cut_depth)
