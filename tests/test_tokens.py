"""Token files (pdjax.apps.data.tokens): written and read back, windows against a plain
reference packing (with and without document separators), the splits, every bad input
refused with a DataError that says what to do, a file changed under a reader, read-time
vocabulary checks, fingerprints, and reading without loading the file."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pdjax.apps.data import Dataset
from pdjax.apps.data import tokens as tk
from pdjax.errors import DataError

# -- independent references -------------------------------------------------------------------


def ref_windows(stream: list[int], seq_len: int) -> list[list[int]]:
    """Windows of seq_len + 1 tokens starting every seq_len tokens, by a plain loop."""
    out, s = [], 0
    while s + seq_len + 1 <= len(stream):
        out.append(stream[s : s + seq_len + 1])
        s += seq_len
    return out


def ref_documents(stream: list[int], sep: int) -> list[list[int]]:
    """Runs of tokens each ending with the separator (and whatever follows the last)."""
    docs: list[list[int]] = [[]]
    for t in stream:
        docs[-1].append(t)
        if t == sep:
            docs.append([])
    return [d for d in docs if d]


def ref_packed(stream: list[int], seq_len: int, sep: int | None) -> tuple[list[list[int]], int]:
    """The windows of a region and the count of its tokens that are in no window."""
    docs = [stream] if sep is None else ref_documents(stream, sep)
    windows, dropped = [], 0
    for d in docs:
        w = ref_windows(d, seq_len)
        windows += w
        covered = {i for k in range(len(w)) for i in range(k * seq_len, k * seq_len + seq_len + 1)}
        dropped += len(d) - len(covered)
    return windows, dropped


def full_windows(x: tk.WindowView, y: tk.WindowView) -> np.ndarray:
    """Inputs and targets glued back into (N, seq_len + 1) windows, checking they agree."""
    xs, ys = np.asarray(x), np.asarray(y)
    assert xs.dtype == np.int32 and ys.dtype == np.int32
    np.testing.assert_array_equal(xs[:, 1:], ys[:, :-1])
    return np.concatenate([xs, ys[:, -1:]], axis=1)


def views(ds: Dataset) -> tuple[tk.WindowView, ...]:
    out = (ds.train_x, ds.train_y, ds.test_x, ds.test_y)
    assert all(isinstance(v, tk.WindowView) for v in out)
    return out  # type: ignore[return-value]


def random_stream(
    n: int, vocab: int, seed: int, sep: int | None = None, p: float = 0.0
) -> np.ndarray:
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, vocab - (sep is not None), n)
    if sep is not None:
        stream[rng.random(n) < p] = sep
    return stream


# -- writing and opening ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vocab", "dtype"), [(50257, "uint16"), (65536, "uint16"), (65537, "uint32")]
)
def test_round_trip(tmp_path: Path, vocab: int, dtype: str) -> None:
    stream = random_stream(5000, vocab, seed=1)
    stream[:2] = [0, vocab - 1]
    path = tmp_path / "train.bin"
    assert tk.write_tokens(path, stream, vocab_size=vocab) == 5000
    # the .bin is nanoGPT's: nothing but little-endian tokens
    np.testing.assert_array_equal(np.fromfile(path, dtype=tk.DTYPES[dtype]), stream)
    side = json.loads((tmp_path / "train.bin.json").read_text())
    assert side == {
        "format": "pdjax-tokens",
        "version": 1,
        "dtype": dtype,
        "vocab_size": vocab,
        "separator": None,
    }
    f = tk.open_tokens(path)
    assert (f.dtype, f.vocab_size, f.separator, len(f)) == (dtype, vocab, None, 5000)
    assert isinstance(f.tokens, np.memmap) and not f.tokens.flags.writeable
    np.testing.assert_array_equal(f.tokens, stream)
    np.testing.assert_array_equal(f.read([3, 1, 4]), stream[[3, 1, 4]].astype(np.int32))


def test_write_refuses_to_overwrite_and_leaves_files(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    tk.write_tokens(path, [1, 2, 3], vocab_size=4)
    with pytest.raises(DataError, match=r"already exists.*overwrite=True"):
        tk.write_tokens(path, [0, 0], vocab_size=4)
    # a bad chunk mid-stream changes nothing on disk, not even with overwrite
    with pytest.raises(DataError, match=r"token 9 at offset 3 is outside the vocabulary 0\.\.3"):
        tk.write_token_chunks(path, [[0, 1], [2, 9]], vocab_size=4, overwrite=True)
    np.testing.assert_array_equal(tk.open_tokens(path).tokens, [1, 2, 3])
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.bin.json"]  # no temporary left
    tk.write_tokens(path, [0, 0], vocab_size=300, separator=0, overwrite=True)
    f = tk.open_tokens(path)
    assert (list(f.tokens), f.vocab_size, f.separator) == ([0, 0], 300, 0)
    with pytest.raises(DataError, match="does not fit dtype uint16"):
        tk.write_tokens(tmp_path / "b.bin", [0], vocab_size=70000, dtype="uint16")
    with pytest.raises(DataError, match="no tokens to write"):
        tk.write_tokens(tmp_path / "c.bin", np.zeros(0, int), vocab_size=3)
    with pytest.raises(DataError, match=r"separator must be a token id in 0\.\.2"):
        tk.write_tokens(tmp_path / "d.bin", [0], vocab_size=3, separator=3)
    assert not (tmp_path / "b.bin").exists() and not (tmp_path / "c.bin").exists()


def test_write_random_tokens_is_chunked_and_seeded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tk, "_CHUNK_TOKENS", 7)  # many chunks, a separator period across them
    tk.write_random_tokens(tmp_path / "a.bin", 100, 50, seed=3, separator_every=10)
    tk.write_random_tokens(tmp_path / "b.bin", 100, 50, seed=3, separator_every=10)
    a, b = tk.open_tokens(tmp_path / "a.bin"), tk.open_tokens(tmp_path / "b.bin")
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.separator == 49
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(a.tokens) == 49), np.arange(9, 100, 10))
    assert a.identity == b.identity


def test_write_side_file_for_a_foreign_bin(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    np.arange(11, dtype="<u2").tofile(path)  # as nanoGPT's prepare.py writes
    with pytest.raises(DataError, match=r"no side file .*train\.bin\.json.*write_side_file"):
        tk.open_tokens(path)
    tk.write_side_file(path, vocab_size=11)
    np.testing.assert_array_equal(tk.open_tokens(path).tokens, np.arange(11))
    with pytest.raises(DataError, match="already exists"):
        tk.write_side_file(path, vocab_size=11)
    with pytest.raises(DataError, match=r"22 bytes, not a whole number of uint32 tokens"):
        tk.write_side_file(path, vocab_size=11, dtype="uint32", overwrite=True)


# -- windows ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [1, 3, 8])
@pytest.mark.parametrize("fraction", [0.1, 0.37])
def test_windows_equal_reference_packing(tmp_path: Path, seq_len: int, fraction: float) -> None:
    stream = random_stream(1001, 97, seed=seq_len)
    path = tmp_path / "t.bin"
    tk.write_tokens(path, stream, vocab_size=97)
    ds = tk.token_dataset(path, seq_len, validation=fraction)
    info = ds.info
    cut = info["train_tokens"]
    assert cut + info["test_tokens"] == info["tokens"] == 1001
    assert abs(info["test_tokens"] - fraction * 1001) <= seq_len + 1  # cut near the fraction
    train_ref, train_drop = ref_packed(stream[:cut].tolist(), seq_len, None)
    test_ref, test_drop = ref_packed(stream[cut:].tolist(), seq_len, None)
    tx, ty, vx, vy = views(ds)
    np.testing.assert_array_equal(full_windows(tx, ty), train_ref)
    np.testing.assert_array_equal(full_windows(vx, vy), test_ref)
    assert info["dropped_tokens"] == train_drop + test_drop
    assert train_drop == 0  # the cut is at a training window's end
    # disjoint: no test window holds a token a training window holds
    assert tx.offsets().max() + seq_len < vx.offsets().min()
    assert (ds.name, ds.num_classes, info["identity"]) == (
        f"tokens:{path}",
        97,
        tk.open_tokens(path).identity,
    )


def test_indexing_like_an_array(tmp_path: Path) -> None:
    stream = random_stream(400, 30, seed=0)
    tk.write_tokens(tmp_path / "t.bin", stream, vocab_size=30)
    ds = tk.token_dataset(tmp_path / "t.bin", 5, validation=0.25)
    tx, _, _, _ = views(ds)
    whole = np.asarray(tx)
    assert tx.shape == whole.shape == (len(tx), 5) and tx.ndim == 2 and tx.dtype == np.int32
    assert tx.size == whole.size
    np.testing.assert_array_equal(tx[3], whole[3])
    np.testing.assert_array_equal(tx[-1], whole[-1])
    np.testing.assert_array_equal(tx[2:9:3], whole[2:9:3])
    idx = np.array([7, 0, -2, 7])
    np.testing.assert_array_equal(tx[idx], whole[idx])
    assert tx[np.zeros(0, int)].shape == (0, 5)
    out = tx[idx]
    out[:] = 0  # a fresh array: writing to it leaves the file alone
    np.testing.assert_array_equal(tx[idx], whole[idx])
    with pytest.raises(IndexError):
        tx[len(tx)]
    with pytest.raises(IndexError):
        tx[np.array([len(tx)])]
    with pytest.raises(TypeError, match="int, a slice or a 1-D integer array"):
        tx[np.zeros((2, 2), int)]
    with pytest.raises(TypeError, match="first axis only"):
        tx[0, 1]
    with pytest.raises(ValueError, match="read-only"):
        tx.setflags(write=True)
    # batching runs on the views as on arrays
    x, y = next(ds.train_batches(4, seed=0, epoch=0))
    assert x.shape == y.shape == (4, 5)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    assert sum(int(m.sum()) for _, _, m in ds.test_batches(4)) == ds.num_test


@pytest.mark.parametrize("seq_len", [1, 4, 16])
def test_separator_packing_against_brute_force(
    tmp_path: Path, seq_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tk, "_CHUNK_TOKENS", 37)  # documents straddle scan chunks
    sep = 0
    stream = random_stream(3000, 64, seed=seq_len, sep=None)
    stream[stream == sep] = 1
    rng = np.random.default_rng(seq_len)
    stream[rng.random(3000) < 0.03] = sep
    stream[[10, 11, 12]] = sep  # empty-ish documents: a lone separator
    stream[-1] = 5  # the last document has no separator: the file's end closes it
    path = tmp_path / "docs.bin"
    tk.write_tokens(path, stream, vocab_size=64, separator=sep)
    ds = tk.token_dataset(path, seq_len, validation=0.2)
    info = ds.info
    cut = info["train_tokens"]
    assert stream[cut - 1] == sep  # the split is at a document boundary...
    seps = np.flatnonzero(stream == sep) + 1
    assert abs(cut - 2400) == np.abs(seps - 2400).min()  # ...the nearest to the fraction
    tx, ty, vx, vy = views(ds)
    train, test = full_windows(tx, ty), full_windows(vx, vy)
    train_ref, train_drop = ref_packed(stream[:cut].tolist(), seq_len, sep)
    test_ref, test_drop = ref_packed(stream[cut:].tolist(), seq_len, sep)
    np.testing.assert_array_equal(train, np.array(train_ref).reshape(-1, seq_len + 1))
    np.testing.assert_array_equal(test, np.array(test_ref).reshape(-1, seq_len + 1))
    assert info["dropped_tokens"] == train_drop + test_drop > 0
    assert info["train_documents"] + info["test_documents"] == len(
        ref_documents(stream.tolist(), sep)
    )
    for w in np.concatenate([train, test]):  # a separator only as a window's last token
        assert sep not in w[:-1].tolist()
    # every window lies inside one document of the file
    doc_of = np.cumsum(np.concatenate([[0], stream[:-1] == sep]))
    for start in np.concatenate([tx.offsets(), vx.offsets()]):
        assert doc_of[start] == doc_of[start + seq_len]


def test_validation_file(tmp_path: Path) -> None:
    a, b = (
        random_stream(300, 40, seed=1, sep=39, p=0.05),
        random_stream(120, 40, seed=2, sep=39, p=0.05),
    )
    tk.write_tokens(tmp_path / "train.bin", a, vocab_size=40, separator=39)
    tk.write_tokens(tmp_path / "val.bin", b, vocab_size=40, separator=39)
    ds = tk.token_dataset(tmp_path / "train.bin", 4, validation=str(tmp_path / "val.bin"))
    tx, ty, vx, vy = views(ds)
    np.testing.assert_array_equal(full_windows(tx, ty), ref_packed(a.tolist(), 4, 39)[0])
    np.testing.assert_array_equal(full_windows(vx, vy), ref_packed(b.tolist(), 4, 39)[0])
    assert (ds.info["train_tokens"], ds.info["test_tokens"]) == (300, 120)
    assert ds.info["validation_identity"] == tk.open_tokens(tmp_path / "val.bin").identity
    tk.write_tokens(tmp_path / "other.bin", b, vocab_size=41, separator=39)
    with pytest.raises(
        DataError, match=r"does not match .*\('uint16', 41, 39\).*\('uint16', 40, 39\)"
    ):
        tk.token_dataset(tmp_path / "train.bin", 4, validation=tmp_path / "other.bin")
    tk.write_tokens(tmp_path / "nosep.bin", b, vocab_size=40)
    with pytest.raises(DataError, match="does not match"):
        tk.token_dataset(tmp_path / "train.bin", 4, validation=tmp_path / "nosep.bin")


# -- bad input --------------------------------------------------------------------------------


def test_size_not_whole_tokens(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    tk.write_tokens(path, [1, 2, 3], vocab_size=10, dtype="uint32")
    with open(path, "ab") as f:
        f.write(b"\x00\x01")
    with pytest.raises(
        DataError,
        match=r"holds 14 bytes, not a whole number of uint32 tokens "
        r"\(4 bytes each; 2 byte\(s\) left over\)",
    ):
        tk.open_tokens(path)
    path.write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        tk.open_tokens(path)


@pytest.mark.parametrize(
    ("side", "match"),
    [
        ({"dtype": "uint16", "vocab_size": 70000}, "vocab_size 70000 does not fit dtype uint16"),
        ({"dtype": "int8", "vocab_size": 7}, r"dtype: expected one of \['uint16', 'uint32'\]"),
        (
            {"dtype": "uint16", "vocab_size": 7, "separator": 7},
            "separator: must be below vocab_size 7",
        ),
        ({"dtype": "uint16", "vocab": 7}, "unknown fields"),
        ({"dtype": "uint16", "vocab_size": "7"}, "vocab_size: expected an integer"),
        (
            {"format": "other", "dtype": "uint16", "vocab_size": 7},
            "format: expected 'pdjax-tokens'",
        ),
        (
            {"version": 2, "dtype": "uint16", "vocab_size": 7},
            "newer than this pdjax reads.*upgrade",
        ),
    ],
)
def test_bad_side_file(tmp_path: Path, side: dict[str, object], match: str) -> None:
    path = tmp_path / "t.bin"
    np.arange(6, dtype="<u2").tofile(path)
    full = {"format": "pdjax-tokens", "version": 1, "separator": None, **side}
    (tmp_path / "t.bin.json").write_text(json.dumps(full))
    with pytest.raises(DataError, match=match):
        tk.open_tokens(path)


def test_missing_files_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        tk.open_tokens(tmp_path / "nothing.bin")
    path = tmp_path / "t.bin"
    np.arange(6, dtype="<u2").tofile(path)
    with pytest.raises(DataError, match=r'no side file .*"format": "pdjax-tokens".*50257'):
        tk.open_tokens(path)
    (tmp_path / "t.bin.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        tk.open_tokens(path)


@pytest.mark.parametrize("sample", [None, 64])
def test_token_beyond_vocabulary_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sample: int | None
) -> None:
    if sample is not None:  # a file larger than the sample: blocks, the last one checked
        monkeypatch.setattr(tk, "_SAMPLE_TOKENS", sample)
        monkeypatch.setattr(tk, "_SAMPLE_BLOCKS", 4)
    path = tmp_path / "t.bin"
    stream = np.zeros(3000, int)
    stream[2990] = 7
    tk.write_tokens(path, stream, vocab_size=10)
    tk.write_side_file(path, vocab_size=5, overwrite=True)
    with pytest.raises(
        DataError, match=r"token 7 at offset 2990 \(byte 5980\) is not below vocab_size 5"
    ):
        tk.open_tokens(path)


def test_token_beyond_vocabulary_at_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tk, "_SAMPLE_TOKENS", 64)  # sample only the first and last 32 tokens
    monkeypatch.setattr(tk, "_SAMPLE_BLOCKS", 2)
    path = tmp_path / "t.bin"
    stream = random_stream(1000, 100, seed=4)
    stream[500] = 150
    tk.write_tokens(path, stream, vocab_size=200)
    tk.write_side_file(path, vocab_size=100, overwrite=True)
    ds = tk.token_dataset(path, 10, validation=0.2)  # the sample is fine
    tx, ty, _, _ = views(ds)
    tx[0], ty[0], tx[60]  # windows away from offset 500 read fine
    with pytest.raises(
        DataError, match=rf"{path}: token 150 at offset 500 .*not below vocab_size 100"
    ):
        tx[50]  # tokens 500..509
    with pytest.raises(DataError, match="token 150 at offset 500"):
        ty[49]  # targets 491..500
    with pytest.raises(DataError, match="token 150 at offset 500"):
        np.asarray(tx)


def test_seq_len_and_fraction_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    tk.write_tokens(path, random_stream(100, 10, seed=0), vocab_size=10)
    for bad in (0, -3):
        with pytest.raises(DataError, match="seq_len must be at least 1"):
            tk.token_dataset(path, bad)
    with pytest.raises(DataError, match="seq_len must be an integer"):
        tk.token_dataset(path, 2.5)  # type: ignore[arg-type]
    with pytest.raises(
        DataError,
        match=r"seq_len 95 is too long for the training split .* it holds 90 tokens.*"
        r"the longest seq_len that works is 89",
    ):
        tk.token_dataset(path, 95, validation=0.1)
    with pytest.raises(
        DataError,
        match=r"seq_len 20 is too long for the validation split .*"
        r"the longest seq_len that works is \d+",
    ):
        tk.token_dataset(path, 20, validation=0.1)
    for bad_fraction in (0.0, 1.0, -0.5, True):
        with pytest.raises(DataError, match=r"validation must be a fraction in \(0, 1\)"):
            tk.token_dataset(path, 4, validation=bad_fraction)


def test_separator_file_too_short_documents_and_one_document(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    stream = np.ones(200, int)
    stream[4::5] = 0  # documents of 5 tokens
    tk.write_tokens(path, stream, vocab_size=3, separator=0)
    assert len(tk.token_dataset(path, 4).train_x) == 36  # one window per document
    with pytest.raises(
        DataError,
        match=r"too long for the training split.*documents, the longest 5 tokens.*"
        r"longest seq_len that works is 4",
    ):
        tk.token_dataset(path, 5)
    tk.write_tokens(path, np.ones(200, int), vocab_size=3, separator=0, overwrite=True)
    with pytest.raises(DataError, match=r"single document.*validation=PATH"):
        tk.token_dataset(path, 4)


# -- changes, identity, memory -----------------------------------------------------------------


def test_file_changed_under_a_reader(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    tk.write_tokens(path, random_stream(500, 10, seed=0), vocab_size=10)
    ds = tk.token_dataset(path, 8)
    tx = ds.train_x
    tx[0]
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))  # same size, touched
    with pytest.raises(DataError, match="changed while training: it held 1000 bytes"):
        tx[0]
    ds = tk.token_dataset(path, 8)
    with open(path, "ab") as f:
        f.write(b"\x01\x00")  # appended to
    with pytest.raises(
        DataError, match=r"changed while training: it held 1000 bytes .* now 1002 bytes"
    ):
        ds.test_y[:2]
    ds = tk.token_dataset(path, 8)
    tk.write_tokens(path, random_stream(501, 10, seed=1), vocab_size=10, overwrite=True)  # replaced
    with pytest.raises(DataError, match=r"changed while training.*replaced"):
        ds.train_x[np.array([1])]


def test_identity(tmp_path: Path) -> None:
    stream = random_stream(4000, 50, seed=0)
    tk.write_tokens(tmp_path / "a.bin", stream, vocab_size=50)
    tk.write_tokens(tmp_path / "copy.bin", stream, vocab_size=50)
    changed = stream.copy()
    changed[2000] = (changed[2000] + 1) % 50
    tk.write_tokens(tmp_path / "b.bin", changed, vocab_size=50)
    tk.write_tokens(tmp_path / "c.bin", stream, vocab_size=51)
    a, copy, b, c = (tk.open_tokens(tmp_path / f"{n}.bin") for n in ("a", "copy", "b", "c"))
    assert json.loads(json.dumps(a.identity)) == a.identity  # JSON-able
    assert a.identity == copy.identity  # content, not the path
    assert a.identity["sha256"] != b.identity["sha256"]
    assert a.identity["sha256"] != c.identity["sha256"] and c.identity["vocab_size"] == 51
    tk.check_identity(a.identity, copy)
    with pytest.raises(
        DataError,
        match=r"not the one this run was trained on \(sha256: .*resume with the same file",
    ):
        tk.check_identity(a.identity, b)


def test_large_file_fingerprint_samples_first_middle_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tk, "_FINGERPRINT_BYTES", 64)
    stream = np.zeros(1000, int)
    tk.write_tokens(tmp_path / "a.bin", stream, vocab_size=9)
    ids = {}
    for name, pos in (("first", 0), ("middle", 500), ("last", 999), ("unsampled", 250)):
        s = stream.copy()
        s[pos] = 1
        tk.write_tokens(tmp_path / f"{name}.bin", s, vocab_size=9)
        ids[name] = tk.open_tokens(tmp_path / f"{name}.bin").identity["sha256"]
    base = tk.open_tokens(tmp_path / "a.bin").identity["sha256"]
    assert base not in (ids["first"], ids["middle"], ids["last"])
    assert ids["unsampled"] == base  # the documented limit: only three blocks are hashed


def test_reading_does_not_load_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tk, "_CHUNK_TOKENS", 1 << 15)
    n = 1 << 21  # 4 MiB of uint16
    path = tmp_path / "big.bin"
    tk.write_random_tokens(path, n, 1000, seed=0, separator_every=1000)
    tracemalloc.start()
    try:
        ds = tk.token_dataset(path, 64, validation=0.1)
        tx, ty, vx, _ = views(ds)
        for i in np.random.default_rng(0).integers(0, len(tx), 20):
            tx[int(i)], ty[int(i)]
        vx[:8]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(isinstance(v.file.tokens, np.memmap) for v in (tx, vx))
    # the window starts (8 bytes per window, ~31k windows) and one scan chunk, not the file
    assert peak < (2 * n) // 4, peak


def test_separator_scan_checks_every_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tk, "_SAMPLE_TOKENS", 64)  # the sample at open misses offset 700
    monkeypatch.setattr(tk, "_SAMPLE_BLOCKS", 2)
    monkeypatch.setattr(tk, "_CHUNK_TOKENS", 100)
    path = tmp_path / "t.bin"
    stream = random_stream(1000, 20, seed=5, sep=19, p=0.05)
    stream[700] = 60
    tk.write_tokens(path, stream, vocab_size=64, separator=19)
    tk.write_side_file(path, vocab_size=20, separator=19, overwrite=True)
    tk.open_tokens(path)
    with pytest.raises(DataError, match=r"token 60 at offset 700 \(byte 1400\)"):
        tk.token_dataset(path, 4)
