"""The code blocks of README.md and docs/*.md, for the tests that run them.

Every fenced block is one of (an HTML comment on the line right before the fence says which):

* ``<!-- example: ID -->`` — run by the test that reads it with :meth:`Docs.commands` or
  :meth:`Docs.python` (the servers, lm-eval, TRL and qmc-eval recipes run in the tests that already
  start those, with the tiny model and their own ports);
* ``<!-- not run: REASON -->`` — cannot run here (a GPU, a cluster, minutes of CPU); the reason is
  required;
* ``<!-- output: PATH -->`` — printed output; every line must be a line of PATH (a committed result);
* no comment, a ``python`` block — run as a script by ``tests/test_docs.py``.

Anything else fails ``tests/test_docs.py``. Placeholders are replaced by plain substitution
(:meth:`Docs.python`, :meth:`Docs.commands`): each one must occur in the block, so a test never
runs a block that no longer says what the test expects.
"""

from __future__ import annotations

import re
import shlex
import string
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!--\s*(example|not run|output):\s*(.*?)\s*-->")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})(\S*)\s*$")

#: How a program a recipe names is started here: the console scripts as ``python -m`` (the tests'
#: own way), in this interpreter's environment.
PROGRAMS = {
    "python": [sys.executable],
    "python3": [sys.executable],
    "qmc-serve": [sys.executable, "-m", "qmc_sampler.server.main"],
    "qmc-eval": [sys.executable, "-m", "qmc_sampler.eval"],
    "lm_eval": [sys.executable, "-m", "lm_eval"],
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    kind: str | None  # "example", "not run", "output" or None
    value: str  # the id, the reason or the path

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass
class Command:
    """One line of a shell recipe: ``VAR=value … program args``, or a ``cat > FILE <<'END'`` here-document."""

    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    file: tuple[str, str] | None = None  # (path, content) of a here-document

    def expanded(self, env: dict[str, str]) -> list[str]:
        """``argv`` with ``$VAR`` taken from ``env`` (then the command's own assignments)."""
        values = env | self.env
        return [string.Template(word).safe_substitute(values) for word in self.argv]


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, lang = opening.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == fence)
        marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None  # the line right before the fence
        kind, value = marker.groups() if marker else (None, "")
        text = textwrap.dedent("\n".join(lines[i + 1 : end]) + "\n")
        blocks.append(Block(page, i + 1, lang, text, kind, value))
        i = end + 1
    return blocks


def substitute(block: Block, replacements: dict[str, str]) -> str:
    text = block.text
    for old, new in replacements.items():
        assert old in text, f"{block.where}: the test replaces {old!r}, which the block no longer contains"
        text = text.replace(old, new)
    return text


def shell_commands(text: str) -> list[Command]:
    lines = text.replace("\\\n", " ").splitlines()
    commands, i = [], 0
    while i < len(lines):
        heredoc = re.fullmatch(r"\s*cat\s*>\s*(\S+)\s*<<\s*'?(\w+)'?\s*", lines[i])
        if heredoc:
            path, tag = heredoc.groups()
            end = lines.index(tag, i + 1)
            commands.append(Command(file=(path, "\n".join(lines[i + 1 : end]) + "\n")))
            i = end + 1
            continue
        line = lines[i]
        i += 1
        while True:  # a quoted argument may span lines (a JSON body)
            try:
                words = shlex.split(line, comments=True)
                break
            except ValueError:
                assert i < len(lines), f"unclosed quotation in {line!r}"
                line, i = f"{line}\n{lines[i]}", i + 1
        if not words:
            continue
        command = Command()
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            command.env[name] = value
        command.argv = [*PROGRAMS.get(words[0], [words[0]]), *words[1:]]
        commands.append(command)
    return commands


class Docs:
    """The blocks of every page, looked up by their ``example`` id."""

    def __init__(self) -> None:
        self.blocks = [b for page in pages() for b in parse(page)]

    def block(self, example: str) -> Block:
        found = [b for b in self.blocks if b.kind == "example" and b.value == example]
        assert len(found) == 1, f"example {example!r}: {len(found)} blocks in README.md and docs/ carry that id"
        return found[0]

    def commands(self, example: str, replacements: dict[str, str] | None = None) -> list[Command]:
        """The recipe ``example``'s command lines, placeholders replaced."""
        return shell_commands(substitute(self.block(example), replacements or {}))

    def python(self, example: str, replacements: dict[str, str] | None = None) -> str:
        """The Python block ``example``'s source, placeholders replaced."""
        return substitute(self.block(example), replacements or {})

    def exec_python(self, example: str, replacements: dict[str, str] | None = None) -> dict:
        """Run the Python block ``example`` in this process as ``__main__``; return its globals."""
        block = self.block(example)
        namespace = {"__name__": "__main__"}
        exec(compile(self.python(example, replacements), block.where, "exec"), namespace)
        return namespace
