"""The documentation's code stays true: every ```python block of README.md, docs/*.md and
packages/*/README.md runs, and every ```bash block names only hatch scripts and files that exist.

A python block runs as written, in a fresh namespace and an empty directory of its own (what it
writes goes there), on one rank of ``ndweave.mesh.testing``'s harness, in processes of its own and
with no process group: the block makes its own mesh, as a user's script does. An HTML comment on
the line before the block changes that:

    <!-- run: torchrun 4 -->          the block runs on 4 ranks, as `torchrun --nproc-per-node 4`
    <!-- run: no (why) -->            not run: an illustrative fragment; the reason is required

Relative links in the same files must point at files that exist.
"""

from __future__ import annotations

import os
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from ndweave.mesh.testing import run_distributed, shutdown_pools

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
DIRECTIVE = re.compile(r"<!--\s*run:\s*(.*?)\s*-->\s*$")
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: what a bash block may start after `hatch run` besides a script: commands hatch runs in the env
COMMANDS = {"python", "pytest", "torchrun"}
#: the folders whose paths a bash block's words are checked for
CHECKED_DIRS = ("examples/", "benchmarks/", "tests/", "packages/", "docs/", ".ci/")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("packages/*/README.md"))]
    return [f for f in files if f.exists()]


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    code: str
    directive: str  # "" (one process), "torchrun N", "no (why)"

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        directive = DIRECTIVE.search(before)
        found.append(Block(path, line, m.group(1), m.group(2), directive.group(1) if directive else ""))
    return found


def all_blocks(lang: str) -> list[Block]:
    return [b for f in doc_files() for b in blocks(f) if b.lang == lang]


def ranks_of(block: Block) -> int | None:
    """How many ranks run the block; ``None``: not run."""
    if not block.directive:
        return 1
    if block.directive.startswith("no"):
        assert re.match(r"no\s*\(.+\)", block.directive), f"{block.name}: `<!-- run: no (why) -->` needs a reason"
        return None
    m = re.fullmatch(r"torchrun\s+(\d+)", block.directive)
    assert m, f"{block.name}: unknown directive {block.directive!r} (use `torchrun N` or `no (why)`)"
    return int(m.group(1))


def run_block(code: str, name: str, folder: str) -> None:
    """One rank's run of a block: in ``folder`` (the same on every rank), in a namespace of its own."""
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(cwd)


PYTHON = all_blocks("python")


@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_python_block_runs(block: Block, tmp_path: Path):
    world = ranks_of(block)
    if world is None:
        pytest.skip(f"{block.name}: {block.directive}")
    try:
        run_distributed(run_block, world, block.code, block.name, str(tmp_path), init_process_group=False, timeout=120)
    finally:
        # fresh processes for the next block, as a user's script gets: DTensor caches meshes by value
        # (not by process group), so a mesh equal to one a finished block destroyed would reuse it
        shutdown_pools()


def test_bash_blocks_name_what_exists():
    hatch = tomllib.loads((ROOT / "hatch.toml").read_text())
    envs = hatch["envs"]
    problems = []
    for block in all_blocks("bash"):
        heredoc = None
        for line in block.code.replace("\\\n", " ").splitlines():
            if heredoc is not None:  # a here-document's lines are another program's input
                heredoc = None if line.strip() == heredoc else heredoc
                continue
            if m := re.search(r"<<-?\s*['\"]?(\w+)", line):
                heredoc, line = m.group(1), line[: m.start()]
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                words = line.split("#", 1)[0].split()
            for i, word in enumerate(words):
                if word == "run" and i > 0 and words[i - 1] == "hatch" and i + 1 < len(words):
                    target = words[i + 1]
                    env, _, script = target.rpartition(":")
                    scripts = envs.get(env or "default", {}).get("scripts", {})
                    if script not in scripts and not (not env and script in COMMANDS):
                        problems.append(f"{block.name}: `hatch run {target}`: no such script in hatch.toml")
                if word.startswith(CHECKED_DIRS) and not (ROOT / word.rstrip(",;")).exists():
                    problems.append(f"{block.name}: {word} does not exist")
    assert not problems, "\n".join(problems)


def test_relative_links_exist():
    problems = []
    for path in doc_files():
        for target in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file = target.split("#", 1)[0]
            if not (path.parent / file).exists():
                problems.append(f"{path.relative_to(ROOT)}: link to {target}: no such file")
    assert not problems, "\n".join(problems)


def test_most_python_blocks_run():
    """Skips say why (``ranks_of``), and stay fewer than the blocks that run."""
    skipped = [b.name for b in PYTHON if ranks_of(b) is None]
    assert len(skipped) <= len(PYTHON) - len(skipped), f"more python blocks skipped than run: {skipped}"
