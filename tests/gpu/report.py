"""The GPU check's report. Each check adds a section (what ran, the figures, pass or fail) as it
goes, before asserting, so a failing check is reported too; at the end of the session the report
is written, dated, to docs/gpu-check/<date>-<device>.md and linked from docs/benchmarks.md (and
after each section where `docs` is set, so a run cut off keeps what it finished).
Both files are written to a temporary file and renamed: a crash never leaves half a report."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

LINKS_HEADING = "## GPU check reports (`make gpu-check`)"
NONE_YET = "(none yet)"


@dataclass
class Section:
    title: str
    lines: list[str]
    passed: bool | None  # None: measured only, nothing asserted


@dataclass
class Report:
    device: str                       # e.g. "NVIDIA H100 80GB HBM3"
    environment: list[str]            # torch, CUDA, driver, NCCL versions; the command
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%d"))
    sections: list[Section] = field(default_factory=list)
    #: where each add() writes the report at once (None: only write() does): a run cut off by its
    #: lease or a hang still leaves every section it finished
    docs: Path | None = None

    def add(self, title: str, lines: list[str], passed: bool | None) -> None:
        self.sections.append(Section(title, list(lines), passed))
        if self.docs is not None:
            self.write(self.docs)

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.device.lower()).strip("-") or "gpu"

    def render(self) -> str:
        verdict = {True: "pass", False: "FAIL", None: "measured"}
        out = [f"# GPU check, {self.date}, {self.device}", "",
               "Written by `make gpu-check` (tests/gpu, pytest marker `gpu`); docs/benchmarks.md links every report.",
               "", *[f"- {line}" for line in self.environment], "", "| check | result |", "|---|---|"]
        out += [f"| {s.title} | {verdict[s.passed]} |" for s in self.sections]
        for s in self.sections:
            out += ["", f"## {s.title} ({verdict[s.passed]})", "", *s.lines]
        return "\n".join(out) + "\n"

    def write(self, docs: Path) -> Path:
        """docs/gpu-check/<date>-<device>.md (a second run the same day replaces it) and its
        link in docs/benchmarks.md (added once)."""
        path = docs / "gpu-check" / f"{self.date}-{self.slug}.md"
        _write_atomic(path, self.render())
        failed = sum(s.passed is False for s in self.sections)
        link = (f"- {self.date}, {self.device}: [gpu-check/{path.name}](gpu-check/{path.name})"
                f" ({len(self.sections) - failed} of {len(self.sections)} checks without failure)")
        index = docs / "benchmarks.md"
        _write_atomic(index, add_link(index.read_text() if index.exists() else "# Benchmarks\n", link, path.name))
        return path


def add_link(text: str, link: str, name: str) -> str:
    """`text` (benchmarks.md) with `link` under LINKS_HEADING (created after the title if absent),
    replacing an earlier link to the same file and the "(none yet)" placeholder."""
    lines = [line for line in text.splitlines() if f"gpu-check/{name})" not in line and line != NONE_YET]
    if LINKS_HEADING not in lines:
        at = 1 if lines and lines[0].startswith("# ") else 0
        lines[at:at] = ["", LINKS_HEADING, ""]
    at = lines.index(LINKS_HEADING) + 2
    lines.insert(min(at, len(lines)), link)
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
