"""The training loop is a library call: its messages name Python keywords
(``batch_size=4096``), and only the command line, a thin layer over it, names flags
(``--batch-size 4096``): :mod:`pdjax.apps.train.wording`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pdjax.apps.cli import main
from pdjax.apps.train import TrainConfig, train
from pdjax.apps.train.wording import command_line, in_command_line, setting
from pdjax.errors import PdjaxError

ROOT = Path(__file__).resolve().parents[1]
FLAG = re.compile(r"--[a-z]")

# -- the mechanism ------------------------------------------------------------------------


def test_a_setting_is_a_keyword_in_python_and_a_flag_on_the_command_line():
    cases = [
        (("batch_size",), "batch_size", "--batch-size"),
        (("batch_size", 33), "batch_size=33", "--batch-size 33"),
        (("plan", "auto"), "plan='auto'", "--plan auto"),
        (("straight", True), "straight=True", "--straight"),
        (("learning_rate", 0.5), "learning_rate=0.5", "--lr 0.5"),
        (("learning_rate",), "learning_rate", "--lr"),
        (("metrics_path",), "metrics_path", "--out"),
        (("checkpoint_dir", Path("/x")), "checkpoint_dir='/x'", "--checkpoint-dir /x"),
        (("weight_stashing", False), "options={'weight_stashing': False}", "--no-weight-stashing"),
    ]
    for args, python, flag in cases:
        assert setting(*args) == python
        with command_line():
            assert setting(*args) == flag
    assert not in_command_line()  # reset after


def test_the_switch_is_reset_after_an_error():
    with pytest.raises(ValueError), command_line():
        raise ValueError
    assert not in_command_line() and setting("seq_len", 8) == "seq_len=8"


# -- the same mistakes, in Python and on the command line ---------------------------------

#: (TrainConfig keywords, the flags saying the same, words of the Python message, words of
#: the command line's).
MISTAKES = [
    (
        dict(min_stages=9, devices=4),
        ["--min-stages", "9", "--devices", "4"],
        "min_stages=9 needs at least 9 devices",
        "--min-stages 9 needs at least 9 devices",
    ),
    (
        dict(warmup_steps=3),
        ["--warmup-steps", "3"],
        "warmup_steps is an option of lr_schedule='warmup-cosine'",
        "--warmup-steps is an option of --lr-schedule warmup-cosine",
    ),
    (
        dict(weight_decay=0.1),
        ["--weight-decay", "0.1"],
        "weight_decay is an option of optimizer='adamw'",
        "--weight-decay is an option of --optimizer adamw",
    ),
    (
        dict(min_stages=2, plan="even"),
        ["--min-stages", "2", "--plan", "even"],
        "plan='even' makes none",
        "--plan even makes none",
    ),
    (
        dict(precision="f16", schedule="dp"),
        ["--precision", "f16", "--schedule", "dp"],
        "precision='f16' trains with dynamic loss scaling",
        "--precision f16 trains with dynamic loss scaling",
    ),
]


@pytest.mark.parametrize(("kw", "argv", "python", "cli"), MISTAKES)
def test_a_config_made_in_python_names_keywords(kw, argv, python, cli):
    with pytest.raises(PdjaxError) as e:
        TrainConfig(**kw)
    assert python in str(e.value), e.value
    assert not FLAG.search(str(e.value)), e.value


@pytest.mark.parametrize(("kw", "argv", "python", "cli"), MISTAKES)
def test_the_command_line_names_its_flags(tmp_path, capsys, kw, argv, python, cli):
    assert main(["train", *argv, "--epochs", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert cli in err, err
    assert not (tmp_path / "out").exists()


def test_train_names_keywords_for_what_it_checks_before_any_work(tmp_path):
    """Settings that only the dataset or the outputs refuse, from train() itself."""
    big = TrainConfig(batch_size=4096, devices=1, epochs=1, schedule="dp")
    with pytest.raises(PdjaxError) as e:
        train(big, metrics_path=tmp_path / "m.jsonl")
    message = str(e.value)
    assert "batch_size=4096 is larger than digits's" in message, message
    assert not FLAG.search(message) and not (tmp_path / "m.jsonl").exists()

    cfg = TrainConfig(batch_size=8, microbatches=1, devices=1, epochs=1, schedule="dp")
    with pytest.raises(PdjaxError) as e:
        train(cfg, resume_step=3)
    message = str(e.value)
    assert "resume_step=3 picks a checkpoint" in message and "checkpoint_dir too" in message
    assert not FLAG.search(message), message


def test_the_command_line_names_flags_for_the_same(tmp_path, capsys):
    out = str(tmp_path / "out")
    argv = ["train", "--batch-size", "4096", "--devices", "1", "--epochs", "1", "--out", out]
    assert main([*argv, "--schedule", "dp"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size 4096 is larger than digits's" in err, err
    argv = ["train", "--batch-size", "8", "--microbatches", "1", "--devices", "1"]
    assert main([*argv, "--schedule", "dp", "--resume-step", "3", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "--resume-step 3 picks a checkpoint" in err and "--checkpoint-dir too" in err, err


# -- every message of the library goes through the mechanism ------------------------------

#: The modules of the training library and its data.
LIBRARY = sorted((ROOT / "pdjax/apps/train").glob("*.py")) + sorted(
    (ROOT / "pdjax/apps/data").glob("*.py")
)
#: Words that may hold ``--x``, per module: advice to run a command (``pdjax plan --out``:
#: that command's words, not a setting of this call) and an XLA flag; the mechanism itself
#: (its table of flags, its rendering) writes flags.
ALLOWED = {
    "model_data.py": ("`pdjax train --devices ", "pdjax plan --out", "XLA_FLAGS=--xla_"),
    "wording.py": ("--",),
}


def _offends(name: str, text: str) -> bool:
    """Whether ``text``, a literal of module ``name``, names a flag by hand."""
    for words in sorted(ALLOWED.get(name, ()), key=len, reverse=True):
        text = text.replace(words, "")
    return bool(FLAG.search(text))


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of ``tree``'s module, classes and functions, and of
    the attribute docstrings (a string statement of its own)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            out.add(id(node.value))
    return out


def _literals(path: Path) -> list[str]:
    """The string literals of ``path`` outside docstrings (comments are not in the tree),
    an f-string as its text with each field as ``{source}``."""
    source = path.read_text()
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.JoinedStr):
            text = "".join(
                v.value
                if isinstance(v, ast.Constant)
                else "{" + (ast.get_source_segment(source, v.value) or "") + "}"
                for v in node.values
            )
            found.append(text)
            skip.update(id(v) for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(node.value)
    return found


def test_no_message_of_the_library_names_a_flag_by_hand():
    assert len(LIBRARY) > 10, LIBRARY
    offending = [
        f"{path.name}: {text!r}"
        for path in LIBRARY
        for text in _literals(path)
        if _offends(path.name, text)
    ]
    assert not offending, "name settings with wording.setting():\n" + "\n".join(offending)


def test_the_scan_finds_a_flag_written_by_hand(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(
        '"""Docstring --ok."""\n'
        "# a comment --ok\n"
        "def f(n):\n"
        '    """--ok too."""\n'
        '    raise ValueError(f"drop --batch-size {n}")\n'
    )
    assert _literals(path) == ["drop --batch-size {n}"]
    assert _offends("model_data.py", "drop --batch-size {n}")
    assert not _offends("model_data.py", "a plan file (pdjax plan --out)")
