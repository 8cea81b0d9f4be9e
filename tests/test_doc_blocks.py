"""Every fenced code block of README.md and docs/*.md runs, so that none can go stale
(docs/api.md#the-code-in-these-documents-runs).

What a fence's language means here:

* ``python``: executed, each document's blocks in order in one namespace (like a doctest
  session), in this process (the suite's 8 CPU devices: a block's
  ``jax.config.update("jax_num_cpu_devices", n)`` is let pass, as in
  tests/test_examples.py), in a temporary working directory. A traceback names the
  document and its line.
* ``bash``, ``sh``, ``shell``, and the ``$``-prompted lines of ``console``: each command
  line is checked without running what it starts: a ``pdjax ...`` or ``python -m pdjax
  ...`` line is parsed by pdjax's own parser (:func:`pdjax.apps.cli.build_parser`: a
  renamed or removed option fails), and a few cheap ones also run (:data:`RUN`); a
  ``python <script>.py ...`` line is parsed by the script's own parser (its
  ``argparse`` parser, stopped once it has parsed); a ``make ...`` line must name targets
  of the Makefile. A line written as a synopsis (``[--measure | --device-model h100]``,
  ``--cost-model pdjax|paper``) is parsed once without its optional parts and once with
  each alternative; a placeholder (``BYTES``, ``<total GPUs>``) stands for the value in
  :data:`PLACEHOLDERS`. ``pip install`` and ``python -m venv`` lines make the environment
  these tests run in: skipped, with that reason. A command of any other program fails
  the test until a rule for it is added here.
* any other language (``text``, ``json``, ``toml``, ...) is not code: a diagram, a
  sketch, program output or a file format, never run. A fence without a language is
  refused: say which it is (a block labelled ``python`` that does not run is a bug: fence
  a sketch or a signature as ``text``).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "sh", "shell", "console"}

#: A synopsis's placeholders, each phrase with a value that stands for it.
PLACEHOLDERS = {
    "--memory-limit BYTES": "--memory-limit 16e9",
    "--devices <total GPUs>": "--devices 8",
    "--num-processes N": "--num-processes 2",
    "--process-id i": "--process-id 0",
}

#: pdjax command lines that also run, in a temporary folder (each takes under a second):
#: a prefix of their arguments. One that reads a file the document supposes it has made
#: (:data:`INPUTS`) is only parsed.
RUN = [("--version",), ("simulate", "--unit-costs")]
INPUTS = (".csv", ".json", ".npz")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its document, the line of its first code line, its language
    (the first word of the fence's info string) and its code, unindented."""

    path: Path
    line: int
    language: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown document (CommonMark's backtick and tilde
    fences, indented by up to 3 spaces)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body = []
        i += 1
        while i < len(lines):
            closing = FENCE.match(lines[i])
            if (
                closing is not None
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"].strip()
            ):
                break
            line = lines[i]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])
            i += 1
        info = opening["info"].split()
        found.append(Block(path, i - len(body) + 1, info[0] if info else "", "\n".join(body)))
        i += 1
    return found


ALL = [block for path in DOCUMENTS for block in blocks(path)]


def test_every_fence_says_what_it_holds():
    assert ALL, "no code blocks found (the fence pattern is wrong)"
    unlabelled = [block.where for block in ALL if not block.language]
    assert not unlabelled, f"fences without a language (python, bash, text, ...): {unlabelled}"


# --- python ------------------------------------------------------------------------------

WITH_PYTHON = [path for path in DOCUMENTS if any(b.language == "python" for b in blocks(path))]


@pytest.mark.parametrize("path", WITH_PYTHON, ids=[p.name for p in WITH_PYTHON])
def test_python_blocks_run(path, tmp_path, monkeypatch):
    import jax

    update = jax.config.update

    def update_but_devices(name, value):  # the suite has its 8 CPU devices already
        if name != "jax_num_cpu_devices":
            update(name, value)

    monkeypatch.setattr(jax.config, "update", update_but_devices)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    for block in blocks(path):
        if block.language != "python":
            continue
        # the block's own lines: a traceback shows the document's lines
        code = compile("\n" * (block.line - 1) + block.code, str(path), "exec")
        failed = None
        try:
            exec(code, namespace)
        except Exception as e:  # its traceback from the block on, with the block's lines
            failed = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        if failed is not None:
            pytest.fail(f"the python block at {block.where}:\n{failed}", pytrace=False)


# --- shell -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """One command of a shell block: where it is written, and its words."""

    where: str
    words: tuple[str, ...]

    def __str__(self) -> str:
        return " ".join(self.words)


def commands(block: Block) -> Iterator[Command]:
    """The commands of a shell block: continued lines joined, comments dropped, a line's
    ``&&`` and ``;`` separating commands, leading ``NAME=value`` settings dropped; in a
    ``console`` block only the ``$``-prompted lines."""
    lines = block.code.splitlines()
    i = 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i]
        i += 1
        if block.language == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        for phrase, value in PLACEHOLDERS.items():
            line = line.replace(phrase, value)
        words = shlex.split(line, comments=True)
        where = f"{block.path.relative_to(ROOT)}:{block.line + start}"
        current: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";", "||"):
                while current and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", current[0]):
                    current.pop(0)
                if current:
                    yield Command(where, tuple(current))
                current = []
            else:
                current.append(word)


def variants(words: tuple[str, ...]) -> list[list[str]]:
    """A synopsis's command lines: without its optional (``[...]``) parts and with the first
    of each ``a|b`` choice, then with each optional part's each alternative (``[x | y]``)
    and each other choice, one at a time.

    >>> variants(("plan", "[--json]", "[--measure", "|", "--model", "h100]", "--m", "a|b"))
    ... # doctest: +NORMALIZE_WHITESPACE
    [['plan', '--m', 'a'], ['plan', '--json', '--m', 'a'], ['plan', '--measure', '--m', 'a'],
     ['plan', '--model', 'h100', '--m', 'a'], ['plan', '--m', 'b']]
    """

    def choices(tokens: list[str]) -> list[list[str]]:
        """Every token's ``a|b`` choices, one token varied at a time."""
        first = [t.split("|")[0] if "|" in t else t for t in tokens]
        out = [first]
        for k, token in enumerate(tokens):
            for other in token.split("|")[1:] if "|" in token else []:
                out.append([*first[:k], other, *first[k + 1 :]])
        return out

    slots: list[list[list[str]]] = []  # each slot's options; the first is the default
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("["):
            slots.append(choices([word]))
            i += 1
            continue
        group = []
        word = word[1:]
        while True:
            closed = word.endswith("]")
            word = word.removesuffix("]")
            assert "[" not in word, f"nested [ ] in a synopsis: {' '.join(words)}"
            if word:
                group.append(word)
            if closed:
                break
            i += 1
            word = words[i]
        i += 1
        alternatives: list[list[str]] = [[]]
        for token in group:
            if token == "|":
                alternatives.append([])
            else:
                alternatives[-1].append(token)
        slots.append([[], *(option for alt in alternatives for option in choices(alt))])
    default = [slot[0] for slot in slots]
    out = [default]
    for k, slot in enumerate(slots):
        out += [[*default[:k], option, *default[k + 1 :]] for option in slot[1:]]
    return [[word for option in variant for word in option] for variant in out]


def _pdjax_words(command: Command) -> list[str] | None:
    """A ``pdjax ...`` or ``python -m pdjax ...`` command's arguments, else None."""
    words = list(command.words)
    if Path(words[0]).name == "pdjax":
        return words[1:]
    if Path(words[0]).name.startswith("python") and words[1:3] == ["-m", "pdjax"]:
        return words[3:]
    return None


def _script(command: Command) -> list[str] | None:
    """A ``python <script>.py ...`` command's script and arguments, else None."""
    words = list(command.words)
    if Path(words[0]).name.startswith("python") and len(words) > 1 and words[1].endswith(".py"):
        return words[1:]
    return None


SHELL_COMMANDS = [c for block in ALL if block.language in SHELLS for c in commands(block)]
SCRIPTS = [c for c in SHELL_COMMANDS if _script(c) is not None]
OTHERS = [c for c in SHELL_COMMANDS if _script(c) is None]


def _make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        rule = re.match(r"^([A-Za-z0-9_.\- ]+):(?!=)", line)
        if rule and not line.startswith("\t"):
            targets |= set(rule[1].split())
    return targets


def _parse(argv: list[str]) -> str | None:
    """pdjax's parser on ``argv``: None, or why it refused (its usage message)."""
    from pdjax.apps.cli import build_parser
    from pdjax.apps.commands import OptionError

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as e:
        said = err.getvalue().strip().splitlines()  # the usage, then the error
        return None if e.code == 0 else (said[-1] if said else f"exit {e.code}")
    except OptionError as e:
        return str(e)
    return None


@pytest.mark.parametrize("command", OTHERS, ids=[f"{c.where}-{c.words[0]}" for c in OTHERS])
def test_shell_lines_name_what_exists(command, tmp_path, monkeypatch):
    words = list(command.words)
    program = Path(words[0]).name
    if program.startswith("pip") or words[1:3] == ["-m", "venv"] or words[1:3] == ["-m", "pip"]:
        pytest.skip("installs packages: these lines made the environment this test runs in")
    argv = _pdjax_words(command)
    if argv is not None:
        refused = {" ".join(v): _parse(v) for v in variants(tuple(argv))}
        refused = {line: why for line, why in refused.items() if why is not None}
        assert not refused, f"{command.where}: pdjax's parser refuses " + "; ".join(
            f"`pdjax {line}`: {why}" for line, why in refused.items()
        )
        reads = any(word.endswith(INPUTS) for word in argv)
        if any(tuple(argv[: len(prefix)]) == prefix for prefix in RUN) and not reads:
            from pdjax.apps.cli import main

            monkeypatch.chdir(tmp_path)
            try:
                status = main(variants(tuple(argv))[0])
            except SystemExit as e:  # --version exits through argparse
                status = e.code
            assert status == 0, f"{command.where}: {command}"
        return
    if program == "make":
        named = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        missing = set(named) - _make_targets()
        assert named and not missing, f"{command.where}: no such Makefile target {missing}"
        return
    pytest.fail(f"{command.where}: no rule to check `{command}` (add one to {Path(__file__).name})")


# Runs each script with its command line until its own argparse parser has parsed it
# (parse_args, or parse_known_args called by the script itself), then stops it: what the
# script would do next is never done. A refused line exits 2, with argparse's message.
_PARSE_ONLY = textwrap.dedent(
    """
    import argparse, json, runpy, sys
    from pathlib import Path

    class Parsed(BaseException):
        pass

    parse_args, parse_known_args = (
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    )
    depth = [0]  # parse_args calls parse_known_args, and so does a command's subparser

    def stop_after(parse):
        def parsed(self, *args, **kwargs):
            depth[0] += 1
            try:
                result = parse(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise Parsed
            return result
        return parsed

    argparse.ArgumentParser.parse_args = stop_after(parse_args)
    argparse.ArgumentParser.parse_known_args = stop_after(parse_known_args)
    failures = {}
    for where, argv in json.loads(sys.argv[1]):
        sys.argv = argv
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        try:
            runpy.run_path(argv[0], run_name="__main__")
            failures[where] = "ran without parsing any arguments"
        except Parsed:
            pass
        except SystemExit as e:
            failures[where] = f"exit {e.code}"
        except BaseException as e:
            failures[where] = f"{type(e).__name__}: {e}"
        sys.path.pop(0)
    print(json.dumps(failures))
    """
)


@pytest.mark.skipif(not SCRIPTS, reason="no python script lines in the documents")
def test_script_lines_parse_with_the_scripts_own_parsers():
    """Each ``python <script>.py ...`` line, in one process (from the repository's root, as
    the documents run them): the script exists and its parser takes the line."""
    lines = [
        (f"{c.where} `{' '.join(v)}`", v)
        for c in SCRIPTS
        for v in variants(tuple(_script(c) or ()))
    ]
    missing = [where for where, argv in lines if not (ROOT / argv[0]).is_file()]
    assert not missing, f"no such script: {missing}"
    done = subprocess.run(
        [sys.executable, "-c", _PARSE_ONLY, json.dumps(lines)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failures, f"refused: {failures}\n{done.stderr[-3000:]}"
