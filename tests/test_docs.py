"""The docs name only what exists, and state the present.

Every inline code span (`...`, outside fenced blocks) of docs/*.md and README.md is read by one
rule:

- a **path** is a span without spaces that ends in `.py`, or whose first part is a folder of the
  repository (`src/`, `tests/`, `configs/`, `docs/`, `infra/`), or a package folder itself
  (`doctor/`). It must exist relative to the repository root, `src/`, `src/shardlab/`, `tests/`
  or the doc's folder; a bare `name.py` may be anywhere under `src/shardlab/` or `tests/`. A glob
  (`tests/test_engine_*.py`) must match a file; a placeholder (`<name>`, `{...}`) is checked up to
  the folder before it; `file.py::test_x` must define `test_x`. GENERATED paths are written by a
  command and absent from a fresh checkout.
- a **config key** is a dotted span whose first part is a config section (`train.steps`,
  `parallel.strategy=fsdp`, `model.lora.*`): it must be a key of the config, or else a code name
  (`train.train_step`).
- a **symbol** is a span that reads as a code name: a call `name(...)`, a dotted name `a.b.c`
  (`shardlab.x.y`, `module.attr`, `Class.method`), a `CamelCase` or `_private` name, a snake_case
  name (`no_sync`), or an ALL_CAPS name with an underscore. It must be defined in src/ or tests/
  (`def name`, `class name`, `name =`, an attribute or argument of that name), or be reached by
  importing (`shardlab.loop.train.train_step`, `train.train_step`, `Engine.shard_layout`,
  `torch.distributed.all_reduce`); a bare third-party name is looked up in THIRD_PARTY_HOMES, and a
  dotted name rooted at one of VARIABLES (`model.parameters()`) on the class it stands for. A bare
  snake_case or ALL_CAPS name that is not a call may also be one the project writes without
  defining it: a JSON field or environment variable in a string literal, a keyword argument, a
  config key's last part, a word of infra/ or the Makefile.
- **prose**, not checked: lowercase words without an underscore (`fsdp`, `bf16`), file names with
  another extension (`metrics.json`), CLI flags, anything with a space that is not a call (shell
  commands), and dotted names rooted at a name nothing resolves (`opt.step()`).
- ALLOWED: the few spans that look like code names but name no Python code (below, each with why).

Besides: link targets and their #anchors exist; `docs/x.md, "Section"` (in docs, code and tests)
names a section of that doc; a `[Note: ...]` a doc names is in the code; docs/plan.md's GPU and
link tables are plan's catalogue; no page cites an issue or tells history. Failures list file:line
and the name, so a rename elsewhere shows every place to update.

src/'s comments and docstrings are read by the same rules (`src_texts`): a file path they write,
backticked or not, exists (`torch/...`: in torch's own source); a backticked name is defined (a
word that only docstrings write does not count, or a stale name would find itself); `[Note: X] in
FILE` (or `, FILE`, ` (FILE)`) is written in FILE; a class's section divider `# -- ... (FILE) --`
names a file that defines one of the methods below it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "shardlab"
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
TOP_DIRS = ("src", "tests", "configs", "docs", "infra")
PATH_BASES = (ROOT, ROOT / "src", PKG, ROOT / "tests")

# Where a bare third-party name (`FakeTensorMode`, `backward()`) is looked up.
THIRD_PARTY_HOMES = (
    "builtins", "mmap.mmap", "torch", "torch.Tensor", "torch.nn", "torch.nn.Module", "torch.nn.parallel",
    "torch.optim.Optimizer", "torch.optim.lr_scheduler.LRScheduler", "torch.utils.data", "torch.amp",
    "torch.overrides", "torch.utils._python_dispatch", "torch._subclasses",
    "torch.distributed", "torch.distributed.Work", "torch.distributed.fsdp", "torch.distributed.fsdp.FSDPModule",
    "torch.distributed.fsdp.sharded_grad_scaler", "torch.distributed.tensor", "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.metadata", "torch.distributed._shard.sharded_tensor",
    "torch.distributed._tools.mem_tracker",
    "torch.distributed._tools.mem_tracker.MemTracker", "torch.distributed.elastic.multiprocessing",
    "transformers", "transformers.PreTrainedModel",
    "transformers.PreTrainedTokenizerBase", "transformers.models.llama.modeling_llama",
    "safetensors", "accelerate",
    "accelerate.utils.FullyShardedDataParallelPlugin", "torch.utils.checkpoint",
    "torch.utils.checkpoint.CheckpointPolicy", "torch.distributed.checkpoint.planner_helpers",
    # what src/'s comments cite from the standard library, torch and transformers
    "struct", "time", "torch.nn.modules.batchnorm", "torch.distributed.tensor.DTensor",
    "torch.distributed.checkpoint.state_dict", "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.rendezvous", "torch._C._distributed_c10d.Reducer", "torch._subclasses.fake_tensor",
    "torch.utils.data.DistributedSampler", "transformers.utils.import_utils", "transformers.initialization",
    "transformers.core_model_loading", "transformers.models.bloom.modeling_bloom",
)
# Roots of dotted names that are import aliases in the docs' prose, and the variables the docs
# write (`model.parameters()`, `engine.local_parameters()`) with the class each stands for.
ALIASES = {"dist": "torch.distributed", "nn": "torch.nn", "F": "torch.nn.functional"}
VARIABLES = {"loss": "torch.Tensor", "model": "torch.nn.Module", "module": "torch.nn.Module", "opt": "torch.optim.Optimizer",
             "engine": "shardlab.engines.api.Engine"}
ALLOWED = {
    "DisruptionTarget": "a Kubernetes pod condition",
    "RuntimeDefault": "a Kubernetes seccomp profile",
    "EligibleTime": "a Slurm job field",
    "MALLOC_ARENA_MAX": "a glibc environment variable",
    "malloc_trim": "a glibc function",
    "PR_SET_PDEATHSIG": "a Linux prctl option (data/prepare.py sets it through ctypes)",
    "_darcs": "a version-control folder that prepare skips",
    "Feistel": "notation: the keyed permutation of data/loader.py",
    "shardlab.forward": "a profiler range name", "shardlab.backward": "a profiler range name",
    "shardlab.optimizer": "a profiler range name",
    "flat_shard_frozen": "the parameter name fsdp_layout.py composes for a frozen group",
    "__metadata__": "the safetensors header's metadata key",
    "_data_files": "a field of the state.json that datasets' save_to_disk writes",
    "sync_bucket_indices": "a C++ function of PyTorch DDP's reducer",
    "run_subtests": "a method of torch's internal distributed test cases (torch.testing._internal)",
    "num_items_in_batch": "a keyword argument of transformers' Trainer.compute_loss",
    "smart_apply": "a function transformers defines inside PreTrainedModel's initialization",
    "embed_scale": "an attribute transformers' scaled word embeddings (Gemma's) set when built",
    "PYTORCH_CUDA_ALLOC_CONF": "PyTorch's CUDA allocator settings, an environment variable",
}
# Paths that a command writes (absent from a fresh checkout).
GENERATED = {"docs/gpu-check/": "make gpu-check writes its reports there (tests/gpu/report.py)"}
FILE_SUFFIXES = (".json", ".yaml", ".yml", ".md", ".txt", ".bin", ".idx", ".safetensors", ".jinja", ".png",
                 ".pkl", ".zst", ".gz", ".sh", ".toml", ".log", ".flight", ".torch", ".jsonl", ".parquet", ".tf")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"{_IDENT}(\.{_IDENT})*")


# -- reading the docs ----------------------------------------------------------------------------
def _prose(doc: Path) -> str:
    """The doc with fenced blocks blanked (line numbers kept)."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), doc.read_text(), flags=re.S | re.M)


def code_spans(doc: Path) -> list[tuple[int, str]]:
    return spans_in(_prose(doc))


def spans_in(text: str) -> list[tuple[int, str]]:
    """(line, span) of every inline code span of `text`, its whitespace collapsed."""
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split()))
            for m in re.finditer(r"(`+)(.+?)\1", text, flags=re.S)]


def links(doc: Path) -> list[tuple[int, str]]:
    text = re.sub(r"(`+)(.+?)\1", lambda m: "\n" * m.group(0).count("\n"), _prose(doc), flags=re.S)
    return [(text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", m.group(1))]


# -- what the tree defines ----------------------------------------------------------------------
@functools.cache
def trees() -> tuple[tuple[Path, ast.Module], ...]:
    """Every Python file of src/shardlab and tests/, parsed once."""
    return tuple((p, ast.parse(p.read_text())) for p in [*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py")])


@functools.cache
def definitions() -> frozenset[str]:
    """Every name defined anywhere in src/ and tests/: functions, classes, assigned names and
    attributes (`self.x =`, `setattr(x, "name", ...)`, `NAME = "attribute_name"`), at any depth."""
    names: set[str] = set()
    for _, tree in trees():
        nodes = list(ast.walk(tree))
        strings = {n.targets[0].id: n.value.value for n in nodes if isinstance(n, ast.Assign)
                   and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Constant)}
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                names.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) == 3:
                arg = node.args[1]
                names.add(str(arg.value if isinstance(arg, ast.Constant) else strings.get(getattr(arg, "id", ""))))
    return frozenset(names)


def _docstrings(tree: ast.Module) -> list[ast.Constant]:
    """The docstrings of a module and of its classes and functions."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.append(first.value)
    return out


@functools.cache
def written_words(docstrings: bool = True) -> frozenset[str]:
    """Names the project writes without defining them: identifiers inside string literals and
    keyword arguments of src/ and tests/ (JSON fields, metric and phase names, environment
    variables, torch's keyword arguments), and every word of infra/ and the Makefile (Terraform
    variables, manifest fields). docstrings=False: not the words of docstrings (which name things
    rather than write them: the check of src/'s own comments, where a stale name would find itself)."""
    out: set[str] = set()
    for _, tree in trees():
        prose = set() if docstrings else {id(d) for d in _docstrings(tree)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
                out.update(re.findall(r"\b\w+\b", node.value))
            elif isinstance(node, ast.keyword) and node.arg:
                out.add(node.arg)
    infra = [p for p in (ROOT / "infra").rglob("*") if p.is_file()] + [ROOT / "Makefile"]
    for path in infra:
        out.update(re.findall(r"\b\w+\b", path.read_text(errors="replace")))
    return frozenset(out)


@functools.cache
def config_keys() -> frozenset[str]:
    from shardlab.config import Config

    out: set[str] = set()

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            out.add(prefix + k)
            if isinstance(v, dict):
                walk(v, prefix + k + ".")

    walk(Config().to_dict(), "")
    return frozenset(out)


# -- paths --------------------------------------------------------------------------------------
def _is_path(span: str) -> bool:
    """A repository path (`tests/x.py`, `docs/`), a module (`engines/api.py`, `toys.py`) or a package
    folder (`doctor/`); deeper paths under a package folder's name (`deploy/gpt2-run/`) are a
    user's folders."""
    if " " in span or "://" in span or not re.fullmatch(r"[\w./<>{}*…\-:,|@~]+", span):
        return False
    first, _, rest = span.partition("/")
    package_dirs = {p.name for p in PKG.iterdir() if p.is_dir() and not p.name.startswith("_")}
    return span.split("::")[0].endswith(".py") or first in TOP_DIRS and bool(rest) or first in package_dirs and not rest


def path_problem(doc: Path, span: str) -> str | None:
    path, _, test = span.partition("::")
    if any(path.startswith(g) for g in GENERATED):
        return None
    placeholder = re.search(r"[<{…|]|\.\.\.", path)
    if placeholder:  # check the folder before the placeholder
        path = path[:placeholder.start()].rpartition("/")[0] + "/"
    bases = (*PATH_BASES, doc.parent)
    if "*" in path:
        found = [p for base in bases for p in base.glob(path.rstrip("/"))]
    else:
        found = [base / path for base in bases if (base / path).exists()]
        if not found and "/" not in path.rstrip("/"):
            found = [*PKG.rglob(path), *(ROOT / "tests").rglob(path)]
    if not found:
        return "no such file"
    if test and not any(re.search(rf"^\s*def {re.escape(test)}\b", p.read_text(), re.M) for p in found):
        return f"{found[0].relative_to(ROOT)} defines no {test}"
    return None


# -- symbols ------------------------------------------------------------------------------------
def _as_symbol(span: str) -> tuple[str, bool] | None:
    """(dotted name, called) when the span reads as a code name, else None."""
    if re.fullmatch(r"[A-Z][A-Z0-9_]+=\S*", span):  # an environment variable set
        return span.split("=")[0], False
    m = re.fullmatch(rf"({_DOTTED.pattern})(\(.*\))?(\.{_IDENT}(\(.*\))?)*", span)
    if not m or span.split("(")[0].endswith(FILE_SUFFIXES) or "=" in span.split("(")[0]:
        return None
    name, called = m.group(1), bool(m.group(3))
    if "." in name or called:
        return name, called
    if re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]*)+", name):
        return name, False  # snake_case: a function, an attribute, a field or a name the code writes
    if re.fullmatch(r"_?[A-Z][a-z]\w*|_\w+|[A-Z][A-Z0-9]*_[A-Z0-9_]+", name):
        return name, False
    return None


def _has(obj: object, attrs: list[str]) -> bool:
    for a in attrs:
        if hasattr(obj, a):
            obj = getattr(obj, a)
        elif a in getattr(obj, "__dataclass_fields__", {}) or a in getattr(obj, "__annotations__", {}):
            return True  # a field without a class default
        else:  # an instance attribute (`self.a = ...`) of a class of ours
            return isinstance(obj, type) and obj.__module__.startswith("shardlab") and a in definitions()
    return True


@functools.cache
def _import(name: str) -> bool:
    """Whether `name` is a module or an attribute reached from one (`torch.distributed.all_reduce`)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return _has(module, parts[i:])
    return False


@functools.cache
def top_level() -> dict[str, list[str]]:
    """name -> the shardlab modules (and test files, as `tests.x`) whose top level defines it; a
    module's last name part also maps to the module itself."""
    out: dict[str, list[str]] = {}
    for path, tree in trees():
        if path.parent.name == "gpu":
            continue
        base = ["shardlab", *path.relative_to(PKG).parts] if path.is_relative_to(PKG) else ["tests", path.name]
        module = ".".join(base).removesuffix(".py").removesuffix(".__init__")
        out.setdefault(module.rpartition(".")[2], []).append(module)
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", node)]
            for t in targets:
                name = getattr(t, "name", None) or getattr(t, "id", None)
                if name:
                    out.setdefault(name, []).append(f"{module}:{name}")
    return out


def _defined_under(place: str, attrs: list[str]) -> bool:
    """Whether module `place` (or `module:name`) has the attribute path `attrs`. Test modules are
    read, not imported (some register toy engines when imported)."""
    module, _, name = place.partition(":")
    path = [name, *attrs] if name else attrs
    if module.startswith("tests."):
        return not path or path[-1] in definitions()
    return _has(importlib.import_module(module), path)


def symbol_problem(name: str, called: bool, docstrings: bool = True) -> str | None:
    parts = name.split(".")
    root, rest = parts[0], parts[1:]
    if name in ALLOWED:
        return None
    if not rest:
        if root in definitions() or any(_import(f"{home}.{root}") for home in THIRD_PARTY_HOMES):
            return None
        if not called and re.fullmatch(r"[a-z][a-z0-9_]*|[A-Z][A-Z0-9_]+", root) and (
                root in written_words(docstrings) or root in {k.rpartition(".")[2] for k in config_keys()}):
            return None
        return "defined nowhere in src/ or tests/, nor in THIRD_PARTY_HOMES"
    if root in VARIABLES and called:
        return None if _import(".".join([VARIABLES[root], *rest])) else f"{VARIABLES[root]} has no {'.'.join(rest)}"
    if root == "shardlab" or root in ALIASES or (root not in top_level() and _import(root)):
        return None if _import(".".join([ALIASES.get(root, root), *rest])) else "cannot be imported"
    places = top_level().get(root, [])
    if any(_defined_under(place, rest) for place in places):
        return None
    if places:
        return f"{root} has no {'.'.join(rest)}"
    return None  # a variable's attribute (`model.parameters()`): nothing to resolve


def span_problem(span: str, docstrings: bool = True) -> str | None:
    """Why a span that reads as a config key or a code name names nothing, or None. docstrings:
    whether a word written in a docstring counts as written (`written_words`)."""
    key = span.split("=")[0].removesuffix(".*")
    sections = {k.split(".")[0] for k in config_keys()}
    if re.fullmatch(_DOTTED.pattern, key) and "." in key and key.split(".")[0] in sections \
            and not key.endswith(FILE_SUFFIXES):
        if key in config_keys():
            return None
        return None if key == span and not symbol_problem(key, False, docstrings) else "neither a config key nor a symbol"
    sym = _as_symbol(span)
    return symbol_problem(*sym, docstrings) if sym else None


# -- the tests ----------------------------------------------------------------------------------
def _rel(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def test_docs_name_only_files_that_exist():
    missing = [f"{_rel(doc)}:{line}: `{span}` ({why})" for doc in DOCS for line, span in code_spans(doc)
               if _is_path(span) and (why := path_problem(doc, span))]
    assert not missing, "files named in the docs that do not exist:\n" + "\n".join(missing)


def test_docs_name_only_symbols_that_exist():
    missing = [f"{_rel(doc)}:{line}: `{span}` ({why})" for doc in DOCS for line, span in code_spans(doc)
               if not _is_path(span) and (why := span_problem(span))]
    assert not missing, "code names in the docs that do not exist:\n" + "\n".join(missing)


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+\s+(.*)$", _prose(doc), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_doc_links_resolve():
    broken = []
    for doc in DOCS:
        for line, target in links(doc):
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{_rel(doc)}:{line}: ({target}) no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{_rel(doc)}:{line}: ({target}) no heading #{anchor} in {dest.name}")
    assert not broken, "links in the docs that lead nowhere:\n" + "\n".join(broken)


HISTORY = [
    (re.compile(r"\b(issues?|PR|pull request)\s+#?\d+", re.I), "an issue number"),
    (re.compile(r"\bthe issue'?s?\b(?! of)", re.I), "a reference to an issue"),
    (re.compile(r"\b(previously|formerly|before this change|used to be|was renamed)\b", re.I), "history"),
    (re.compile(r"^#+ .*\b(history|changelog)\b", re.I | re.M), "a history section"),
]


def test_docs_state_the_present():
    """Reference pages say what is true now: no issue numbers, no history (dated benchmark
    figures keep their dates)."""
    found = []
    for doc in DOCS:
        text = _prose(doc)
        for pattern, what in HISTORY:
            for m in pattern.finditer(text):
                found.append(f"{_rel(doc)}:{text.count(chr(10), 0, m.start()) + 1}: {what}: {m.group(0)!r}")
    assert not found, "\n".join(found)


# -- references to docs and Notes, from anywhere ------------------------------------------------
def _referring_files() -> list[Path]:
    code = [*PKG.rglob("*.py"), *PKG.rglob("*.yaml"), *(ROOT / "tests").rglob("*.py")]
    return [p for p in [*DOCS, *code, ROOT / "Makefile"] if p != Path(__file__).resolve()]


def _normal(text: str) -> str:
    return " ".join(text.replace("`", "").lower().split())


def _sections(doc: Path) -> tuple[list[str], list[str]]:
    """(its headings, its paragraphs' bold leads: `**Atomicity.** ...`), normalized."""
    text = _prose(doc)
    return ([_normal(h) for h in re.findall(r"^#+\s+(.*)$", text, re.M)],
            [_normal(b) for b in re.findall(r"^\*\*(.+?)\*\*", text, re.M | re.S)])


def test_references_to_docs_and_their_sections_resolve():
    """`docs/x.md` named anywhere (docs, code, tests) exists; `docs/x.md, "Section"` or
    `docs/x.md ("Section")` names a section: words of one of its headings (dated headings carry
    more), or the start of a paragraph's bold lead."""
    broken = []
    for path in _referring_files():
        text = path.read_text()
        for m in re.finditer(r"\bdocs/([\w.-]+\.md)(?:,?\s+\(?\"([^\"]+)\")?", text):
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            doc = ROOT / "docs" / m.group(1)
            if not doc.exists():
                broken.append(f"{where}: docs/{m.group(1)} does not exist")
            elif m.group(2):
                section = _normal(m.group(2))
                heads, leads = _sections(doc)
                if not any(section in h for h in heads) and not any(b.startswith(section) for b in leads):
                    broken.append(f"{where}: docs/{m.group(1)} has no section \"{m.group(2)}\"")
    assert not broken, "references to docs that lead nowhere:\n" + "\n".join(broken)


def test_notes_named_in_the_docs_exist():
    """A `[Note: ...]` a doc points to is written once in src/ or tests/."""
    code = " ".join(" ".join(p.read_text().replace("#", " ").split())
                    for p in [*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py")])
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"\[Note: ([^\]]+)\]", text):
            if f"[Note: {' '.join(m.group(1).split())}]" not in code:
                missing.append(f"{_rel(doc)}:{text.count(chr(10), 0, m.start()) + 1}: [Note: {m.group(1)}]")
    assert not missing, "Notes the docs name that the code does not have:\n" + "\n".join(missing)


# -- docs/plan.md's tables are plan's catalogue -----------------------------------------------------
def _table(doc: Path, header: str) -> dict[str, list[str]]:
    """First cell (backticks stripped) -> the row's cells, of the table whose header starts so."""
    text = doc.read_text()
    rows = text[text.index(header):].split("\n\n")[0].splitlines()[2:]
    cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
    return {c[0].replace("`", "").split(" (")[0]: c for c in cells}


def test_plan_md_gpu_and_link_tables_match_the_catalogue():
    from shardlab.plan.catalogue import GPUS, INTERCONNECTS, usable_bytes

    doc = ROOT / "docs" / "plan.md"
    gpus = _table(doc, "| `--gpu` | memory |")
    assert set(gpus) == set(GPUS), f"docs/plan.md's GPU table lists {sorted(gpus)}, the catalogue {sorted(GPUS)}"
    for name, g in GPUS.items():
        row = gpus[name]
        assert row[1] == f"{g.memory_bytes / 1e9:.0f} GB", (name, row)
        assert row[2].startswith("yes" if g.bf16 else "no"), (name, row)
        assert row[3] == f"{g.peak_flops / 1e12:.0f} T", (name, row)
        assert row[4].split()[0] == f"`{g.intra_node}`" and row[5] == f"`{g.inter_node}`", (name, row)
        assert row[6] == f"{usable_bytes(g) / 2**30:.2f} GiB", (name, row)
    links = _table(doc, "| link | alpha |")
    assert set(links) == set(INTERCONNECTS), f"docs/plan.md's link table lists {sorted(links)}"
    for name, link in INTERCONNECTS.items():
        if link.per_kind:
            assert links[name][1] == "per kind", (name, links[name])
            continue
        assert links[name][1] == f"{link.alpha_s * 1e6:g} us", (name, links[name])
        assert links[name][2] == f"{link.bandwidth / 1e9:g} GB/s", (name, links[name])


# -- comments and docstrings of src/ name what exists, where they say -----------------------------
@functools.cache
def src_texts() -> tuple[tuple[Path, int, str], ...]:
    """(file, first line, text) of every docstring of src/shardlab (module, class, function) and
    of every run of consecutive comment lines there, the `#` dropped (a name or a Note may wrap)."""
    out = []
    for path, tree in trees():
        if not path.is_relative_to(PKG):
            continue
        out += [(path, d.lineno, d.value) for d in _docstrings(tree)]
        run: list[tuple[int, str]] = []
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for tok in [*(t for t in tokens if t.type == tokenize.COMMENT), None]:
            if run and (tok is None or tok.start[0] != run[-1][0] + 1):
                out.append((path, run[0][0], "\n".join(text for _, text in run)))
                run = []
            if tok is not None:
                run.append((tok.start[0], re.sub(r"^#+:?", "", tok.string)))  # `#:` documents a name
    return tuple(out)


def _src_rel(path: Path, first: int, text: str, at: int) -> str:
    return f"{path.relative_to(ROOT)}:{first + text.count(chr(10), 0, at)}"


#: a file path written in a comment or docstring, backticked or not: a word ending in .py (a test
#: named after ::), or under a folder of the repository (`tests/gpu/`, `configs/x.yaml`)
_SRC_PATH = re.compile(r"(?<![\w./`-])((?:[\w.-]+/)*[\w-]+\.py(?:::\w+)?|(?:" + "|".join(TOP_DIRS)
                       + r")/[\w./*<>{}-]*)(?![\w/])")
#: where a path into torch's own source (`torch/distributed/rendezvous.py`) is read
SITE_PACKAGES = Path(importlib.util.find_spec("torch").origin).parents[1]


def test_src_comments_name_only_files_that_exist():
    """A file path in src/'s comments and docstrings exists (the rules of the docs' paths, the
    writing file's folder a base too)."""
    missing = []
    for path, first, text in src_texts():
        for m in _SRC_PATH.finditer(text):
            span = m.group(1).rstrip(".")
            if span.startswith("torch/"):
                why = None if (SITE_PACKAGES / span).exists() else "not in torch's source"
            else:
                why = path_problem(path, span) if _is_path(span) else None
            if why:
                missing.append(f"{_src_rel(path, first, text, m.start())}: {span} ({why})")
    assert not missing, "files named in src/'s comments that do not exist:\n" + "\n".join(missing)


def test_src_comments_name_only_symbols_that_exist():
    """A backticked code name in src/'s comments and docstrings is defined (the docs' rules)."""
    missing = []
    for path, first, text in src_texts():
        for line, span in spans_in(text):
            if not _is_path(span) and (why := span_problem(span, docstrings=False)):
                missing.append(f"{path.relative_to(ROOT)}:{first + line - 1}: `{span}` ({why})")
    assert not missing, "code names in src/'s comments that do not exist:\n" + "\n".join(missing)


#: `[Note: X] in FILE`, `[Note: X], FILE`, `[Note: X] (FILE)`: the Note is said to be written in FILE
_NOTE_IN = re.compile(r"\[Note: ([^\]]+)\](?:,\s*|\s+in\s+|\s+\((?:in\s+)?)(?:`)?((?:[\w.-]+/)*[\w-]+\.py)")


def _notes_written_in(path: Path) -> set[str]:
    """The Notes `path` writes: a `[Note: X]` alone on its line (a comment's or a docstring's)."""
    return {" ".join(m.group(1).split())
            for m in re.finditer(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$", path.read_text(), re.M)}


def test_notes_named_with_a_file_are_in_that_file():
    """`[Note: X] in FILE` (or `, FILE`, ` (FILE)`) in src/'s comments and docstrings: FILE exists
    and writes that Note."""
    wrong = []
    for path, first, text in src_texts():
        for m in _NOTE_IN.finditer(text):
            note, name = " ".join(m.group(1).split()), m.group(2)
            bases = (*PATH_BASES, path.parent)
            found = [b / name for b in bases if (b / name).is_file()] or [*PKG.rglob(name)]
            where = _src_rel(path, first, text, m.start())
            if not found:
                wrong.append(f"{where}: [Note: {note}] in {name}: no such file")
            elif not any(note in _notes_written_in(f) for f in found):
                homes = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if note in _notes_written_in(p)]
                wrong.append(f"{where}: [Note: {note}] is not in {name} (written in: {homes or 'nowhere'})")
    assert not wrong, "Notes src/ places in a file that does not write them:\n" + "\n".join(wrong)


def _methods_defined_in(path: Path) -> set[str]:
    return {f.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
            for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_section_dividers_name_the_files_their_methods_answer():
    """A divider in a class, `# -- Measurable (engines/measuring.py) ----`, sends the reader to the
    file whose classes declare the methods below it: that file (one of those it names) defines at
    least one of them."""
    wrong = []
    for path, tree in trees():
        if not path.is_relative_to(PKG):
            continue
        lines = path.read_text().splitlines()
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            methods = {f.lineno: f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
            dividers = [(i, line) for i in range(cls.lineno, cls.end_lineno + 1)
                        if re.match(r"\s*# -- .*\.py.*-{3,}\s*$", line := lines[i - 1])]
            for k, (at, line) in enumerate(dividers):
                end = dividers[k + 1][0] if k + 1 < len(dividers) else cls.end_lineno + 1
                below = {name for lineno, name in methods.items() if at < lineno < end}
                files = [f for group in re.findall(r"\(([^)]*)\)", line) for f in re.findall(r"[\w/]+\.py", group)]
                found = [p for name in files for p in [*(b / name for b in PATH_BASES), path.parent / name] if p.is_file()]
                if not any(below & _methods_defined_in(p) for p in found):
                    wrong.append(f"{path.relative_to(ROOT)}:{at}: {', '.join(files)} defines none of {sorted(below)}")
    assert not wrong, "section dividers that send the reader to the wrong file:\n" + "\n".join(wrong)
