"""Files pdjax names itself (issue 44): the checkpoint folder's lock and markers, the
tokenizer cache, outputs beside others are opened only as regular files (a symbolic link
there is never followed, a FIFO never waited on, a device never read, reads bounded), a
cache entry is trusted only if it is the tokenizer asked for, an output folder given as a
link is refused, and token ids and bucket lengths are checked rather than cast.

Nothing here trains a model: the tokenizers are tiny, the checkpoint folders hold no
step, and the command is refused before any work. A FIFO that code would wait on forever
is a test failure after a few seconds (:func:`no_hang`), not a hung suite."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_cli_fuzz import time_limit

from pdjax._jsonio import append_text, check_folder, write_atomic
from pdjax.apps.cli import main
from pdjax.errors import CheckpointError, DataError, PdjaxError
from pdjax.runners import Checkpointer


class Hung(BaseException):
    """A block ran too long (a BaseException: no ``except OSError`` or ``except Exception``
    of the code under test takes it for a failed read)."""


def no_hang(seconds: int = 20) -> contextlib.AbstractContextManager[None]:
    """Fails the block if it runs past ``seconds`` (a read or open waiting on a FIFO)."""
    return time_limit(seconds, Hung(f"blocked for {seconds} s: waiting on a FIFO?"))


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """An empty file of the user's, outside any folder pdjax writes."""
    path = tmp_path / "victim.txt"
    path.write_text("")
    return path


# -- the helpers ---------------------------------------------------------------------------


def test_a_fixed_name_is_opened_only_as_a_regular_file(tmp_path, victim):
    from pdjax._jsonio import open_regular, read_regular

    (tmp_path / "link").symlink_to(victim)
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    (tmp_path / "zero").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"x" * 101)
    (tmp_path / "small").write_bytes(b"x" * 100)
    with no_hang():
        for name, words in [("link", "symbolic link"), ("dangling", "symbolic link"),
                            ("zero", "symbolic link"), ("fifo", r"FIFO \(named pipe\), not a "
                            "regular file"), (".", "a folder"), ("big", "more than 100 bytes"),
                            ("missing", "No such file")]:  # fmt: skip
            with pytest.raises(PdjaxError, match=f"cannot read the thing .*{name}: .*{words}"):
                read_regular(tmp_path / name, "the thing", max_bytes=100)
        assert read_regular(tmp_path / "small", "the thing", max_bytes=100) == b"x" * 100
        for name in ("link", "dangling", "fifo"):
            with pytest.raises(PdjaxError, match=f"cannot write the thing .*{name}: it is a"):
                open_regular(tmp_path / name, os.O_WRONLY | os.O_CREAT, "the thing")
            with pytest.raises(PdjaxError, match=f"{name}: it is a"):
                append_text(tmp_path / name, "x\n", what="the thing")
            # an atomic write would replace a FIFO (or a device) by its rename: refused
            with pytest.raises(PdjaxError, match=f"cannot write the thing .*{name}: it is a"):
                write_atomic(tmp_path / name, "x", what="the thing")
    assert (tmp_path / "fifo").is_fifo() and not (tmp_path / "nothing").exists()
    assert victim.read_text() == ""
    with pytest.raises(PdjaxError, match="a character device"):
        open_regular("/dev/null", os.O_RDONLY, "the thing")


# -- item 7: the checkpoint folder's lock and markers ---------------------------------------


@pytest.mark.parametrize("kind", ["link", "dangling", "fifo"])
def test_the_lock_is_never_written_through_a_link_or_into_a_fifo(tmp_path, victim, kind):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    lock = folder / "pdjax.lock"
    if kind == "link":
        lock.symlink_to(victim)
    elif kind == "dangling":
        lock.symlink_to(tmp_path / "made-through-the-link")
    else:
        os.mkfifo(lock)
    words = "a symbolic link" if kind != "fifo" else r"a FIFO \(named pipe\), not a regular file"
    with no_hang(), Checkpointer(folder) as ckpt:
        with pytest.raises(
            CheckpointError, match=f"checkpoint lock file .*pdjax.lock: it is {words}"
        ):
            ckpt.claim()
    assert victim.read_text() == "" and not (tmp_path / "made-through-the-link").exists()
    assert os.path.lexists(lock)  # left as it was


def test_a_marker_that_is_a_fifo_is_no_pdjax_step_and_is_not_waited_on(tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "5").mkdir(parents=True)
    os.mkfifo(folder / "5" / "pdjax-step.json")
    with no_hang(), pytest.raises(CheckpointError, match=r"holds '5', named like checkpoint"):
        Checkpointer(folder)
    assert (folder / "5" / "pdjax-step.json").is_fifo()


# -- item 6: the tokenizer cache -------------------------------------------------------------


@pytest.fixture(scope="module")
def texts() -> list[str]:
    from pdjax.apps.data import bpe as td

    pytest.importorskip("tokenizers")
    train, _ = td.split_documents(td.documents(), 0, 0.1)
    return [d.text for d in train[:20]]


def _cached(texts: list[str], cache: Path) -> tuple[object, Path, dict]:
    from pdjax.apps.data import bpe as td

    first = td.train_tokenizer(texts, 300, cache_dir=cache)
    (path,) = cache.glob("bpe-*.json")
    return first, path, json.loads(path.read_text())


def test_a_cache_entry_that_is_a_fifo_a_link_or_too_large_is_not_read(tmp_path, texts):
    from pdjax.apps.data import bpe as td

    first, path, _ = _cached(texts, tmp_path)
    path.unlink()
    os.mkfifo(tmp_path / "fifo")

    def huge() -> str:
        size = td._ENTRY_BASE_BYTES + td._ENTRY_BYTES_PER_ID * 300
        with open(path, "wb") as f:
            f.truncate(size + 1)  # sparse: no disk used
        return f"more than {size} bytes"

    cases = [
        lambda: os.mkfifo(path) or r"a FIFO \(named pipe\), not a regular file",
        lambda: path.symlink_to(tmp_path / "fifo") or "a symbolic link",
        lambda: path.symlink_to("/dev/zero") or "a symbolic link",
        huge,
    ]
    for make in cases:
        words = make()
        before = os.lstat(path)
        with no_hang(), pytest.warns(UserWarning, match=f"not a pdjax cache entry .*{words}"):
            got = td.train_tokenizer(texts, 300, cache_dir=tmp_path)
        assert got.origin == "trained" and got.json == first.json
        after = os.lstat(path)
        assert (after.st_ino, after.st_mode, after.st_size) == (
            before.st_ino,
            before.st_mode,
            before.st_size,
        )  # left alone
        path.unlink()


def _forged_tokenizers(texts: list[str]) -> dict[str, str]:
    """Tokenizer JSONs that are not text_bpe's for 300 ids: another vocabulary size, 5 ids
    without the byte alphabet, the recipe without EOT and PAD."""
    import tokenizers as tk

    from pdjax.apps.data import bpe as td

    tiny = tk.Tokenizer(tk.models.BPE({c: i for i, c in enumerate("abcde")}, []))
    bare = tk.Tokenizer(tk.models.BPE())
    bare.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bare.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=300,
        min_frequency=2,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bare.train_from_iterator(texts, trainer=trainer)
    return {
        "280 ids": td._train(texts, 280),
        "5 ids": tiny.to_str(),
        "no EOT or PAD": bare.to_str(),
    }


def test_a_cache_entry_is_trusted_only_if_it_is_the_tokenizer_asked_for(tmp_path, texts):
    from pdjax.apps.data import bpe as td

    first, path, entry = _cached(texts, tmp_path)
    for name, forged in _forged_tokenizers(texts).items():
        # consistent: this key, the recipe, the vocabulary size, its own fingerprint
        path.write_text(
            json.dumps(
                {**entry, "tokenizer": forged, "fingerprint": td.tokenizer_fingerprint(forged)}
            )
        )
        got = td.train_tokenizer(texts, 300, cache_dir=tmp_path)
        assert (got.origin, got.json == first.json) == ("retrained", True), name
        assert json.loads(path.read_text()) == entry, name  # pdjax's entry: rebuilt
    # an entry whose tokenizer has fewer ids than asked is never written (not checkable)
    few = td.train_tokenizer(texts[:1], 20000, cache_dir=tmp_path / "few")
    assert few.vocab_size < 20000 and not list((tmp_path / "few").glob("bpe-*"))
    assert td.train_tokenizer(texts, 300, cache_dir=tmp_path).origin == "cache"


# -- item 10 (part): output folders given as links ------------------------------------------


@pytest.mark.parametrize("option", ["--out", "--checkpoint-dir", "--tensorboard"])
def test_an_output_folder_given_as_a_link_is_refused_before_any_work(tmp_path, option, capsys):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    argv = ["train", "--devices", "2", "--epochs", "1", "--plan", "even"]
    if option != "--out":
        argv += ["--out", str(tmp_path / "out")]
    rc = main([*argv, option, str(tmp_path / "link")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert option in err and "symbolic link" in err and "Traceback" not in err
    assert list(real.iterdir()) == [] and not (tmp_path / "out").exists()
    with pytest.raises(PdjaxError, match="symbolic link"):
        check_folder(tmp_path / "link", "--x")
    check_folder(tmp_path / "link", "--x", link=True)  # where a caller lets links through


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_run_folders_own_files_are_read_only_as_regular_files(tmp_path, victim, kind):
    from pdjax.apps.train import read_metrics
    from pdjax.apps.train.resume import PLAN_FILE, saved_plan

    for path in (tmp_path / "metrics.jsonl", tmp_path / PLAN_FILE):
        if kind == "link":
            path.symlink_to(victim)
        else:
            os.mkfifo(path)
    with no_hang(), pytest.raises(PdjaxError, match="metrics file"):
        read_metrics(tmp_path / "metrics.jsonl")
    with no_hang(), pytest.raises(PdjaxError, match="saved plan"):
        saved_plan(tmp_path)


# -- item 5 (part): token ids and bucket lengths checked, not cast -------------------------


@pytest.mark.parametrize(
    ("examples", "kwargs", "words"),
    [
        ([[5, 6], [1.5, 2.7]], {}, r"example 1 holds float64 values \(1.5 at position 0\)"),
        ([[5, 2**40]], {}, r"example 0 holds the token id 1099511627776 at position 1, past int32"),
        ([[5, -1, 6]], {}, r"example 0 holds the token id -1 at position 1: token ids are non-neg"),
        ([[5, 6, 7]], {"lengths": (4.5, 8)}, r"bucket length 0 is 4.5: .* pass integers"),
        ([[5, 6], np.zeros((2, 3), np.int32)], {}, r"example 1 has shape \(2, 3\), not a 1-D"),
        ([[True, False]], {}, r"example 0 holds bool values"),
        ([[5, 300]], {"vocab_size": 300}, r"example 0 holds the token id 300 .*vocabulary's 300"),
        ([[5, 6]], {"pad_id": -1}, r"pad_id holds the token id -1"),
        ([[5, 6]], {"pad_id": 1.0}, r"pad_id must be an integer, got 1.0"),
    ],
    ids=["float", "2**40", "negative", "length-4.5", "2-D", "bool", "past-vocab", "pad-negative",
         "pad-float"],
)  # fmt: skip
def test_bucket_examples_refuses_what_it_would_cast(examples, kwargs, words):
    from pdjax.apps.data import bpe as td

    kwargs = {"lengths": (4, 8), "pad_id": 1, **kwargs}
    with pytest.raises(DataError, match=words):
        td.bucket_examples(examples, **kwargs)


def test_documents_are_checked_too_and_good_input_still_buckets():
    from pdjax.apps.data import bpe as td

    with pytest.raises(DataError, match=r"document 1 holds float64 values"):
        td.document_examples([np.arange(3), np.array([1.5, 2.0])], 0, 4)
    with pytest.raises(DataError, match=r"document 0 holds the token id -1"):
        td.pack([np.array([3, -1, 4])], 0, 2)
    with pytest.raises(DataError, match=r"max_len must be an integer, got 4.5"):
        td.document_examples([np.arange(3)], 0, 4.5)
    b = td.bucket_examples([[5, 6, 7], np.arange(9, dtype=np.uint8)], (4, np.int64(8)), pad_id=1,
                           vocab_size=300)  # fmt: skip
    np.testing.assert_array_equal(b.buckets[0].inputs, [[5, 6, 1, 1]])
    assert b.lengths == (4, 8) and b.buckets[1].inputs.dtype == np.int32


# -- outputs the library writes at a path it is given ----------------------------------------


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_torch_csv_is_never_written_through_a_link_or_into_a_fifo(tmp_path, victim, kind):
    from pdjax.schedules import generate
    from pdjax.schedules.torch_csv import read_torch_csv, write_torch_csv

    path = tmp_path / "sched.csv"
    if kind == "link":
        path.symlink_to(victim)
    else:
        os.mkfifo(path)
    with no_hang(), pytest.raises(PdjaxError, match="CSV"):
        write_torch_csv(generate("1f1b", 2, 2), path)
    assert victim.read_text() == "" and (path.is_symlink() or path.is_fifo())
    write_torch_csv(generate("1f1b", 2, 2), tmp_path / "ok.csv")
    assert read_torch_csv(tmp_path / "ok.csv").actions == generate("1f1b", 2, 2).actions


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_chrome_trace_is_never_written_through_a_link_or_into_a_fifo(tmp_path, victim, kind):
    from pdjax.schedules import generate
    from pdjax.simulator import simulate, unit_costs, write_chrome_trace

    timeline = simulate(generate("1f1b", 2, 2), unit_costs(2)).timeline
    path = tmp_path / "trace.json"
    if kind == "link":
        path.symlink_to(victim)
    else:
        os.mkfifo(path)
    with no_hang(), pytest.raises(PdjaxError, match="trace"):
        write_chrome_trace(timeline, path)
    assert victim.read_text() == "" and (path.is_symlink() or path.is_fifo())
