"""BPE text data: a deterministic, cached tokenizer, disjoint document splits, packing,
tokenizer fingerprints, and variable-length buckets."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pdjax.apps import data
from pdjax.apps.data import bpe as td
from pdjax.errors import DataError

pytest.importorskip("tokenizers")

# trains the tokenizer of text_bpe's default split and prints its JSON's SHA-256
_TRAIN_AND_HASH = """
import hashlib
from pdjax.apps.data import bpe as td
train, _ = td.split_documents(td.documents(), 0, 0.1)
tok = td.train_tokenizer([d.text for d in train], 1024, cache=False)
print(hashlib.sha256(tok.json.encode()).hexdigest())
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizers")


@pytest.fixture(scope="module")
def ds(cache):
    return td.text_bpe(seq_len=32, cache_dir=cache)


@pytest.fixture(scope="module")
def split():
    return td.split_documents(td.documents(), 0, 0.1)


def test_training_is_deterministic_across_processes(split):
    """Two fresh processes, one without tokenizers' thread pool, train the same JSON."""
    runs = []
    for env in ({"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}, {}):
        runs.append(
            subprocess.Popen(
                [sys.executable, "-c", _TRAIN_AND_HASH],
                env={**os.environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    for proc in runs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outs.append(out.strip())
    here = td.train_tokenizer([d.text for d in split[0]], 1024, cache=False)
    assert outs[0] == outs[1] == here.fingerprint.removeprefix("sha256:")


def test_documents_split_whole_and_disjoint(split):
    docs = td.documents()
    train, test = split
    keys = [d.key for d in docs]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert {d.key for d in train}.isdisjoint(d.key for d in test)
    assert sorted(d.key for d in (*train, *test)) == keys
    chars = sum(len(d.text) for d in docs)
    assert 0 < sum(len(d.text) for d in test) <= 0.1 * chars
    assert td.split_documents(docs, 0, 0.1) == split
    assert td.split_documents(docs, 1, 0.1)[1] != test
    with pytest.raises(DataError, match="test_fraction"):
        td.split_documents(docs, 0, 1.0)


def test_roundtrip_on_unseen_text(ds, split):
    """Test documents (unseen by the tokenizer), odd characters and a literal special
    token come back exactly; the literal is not read as the special token."""
    tok = td.BPETokenizer(ds.info["tokenizer_json"])
    assert (tok.eot_id, tok.pad_id) == (0, 1) and tok.vocab_size == ds.vocab_size == 1024
    for d in split[1]:
        assert tok.decode(tok.encode(d.text)) == d.text
    odd = "naïve café — 数据 🚀 <|endoftext|> end\n\t"
    ids = tok.encode(odd)
    assert tok.decode(ids) == odd and tok.eot_id not in ids.tolist()


def test_packing_shapes_shift_and_test_text(ds, split):
    seq = 32
    for x, y in ((ds.train_x, ds.train_y), (ds.test_x, ds.test_y)):
        assert x.shape == y.shape and x.shape[1] == seq and x.dtype == y.dtype == np.int32
        np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
        np.testing.assert_array_equal(x[1:, 0], y[:-1, -1])  # windows continue the stream
        assert 0 <= x.min() and x.max() < ds.vocab_size
    assert ds.name == "text-bpe" and ds.info["test_documents"] == tuple(d.key for d in split[1])
    assert ds.num_test == (ds.info["test_tokens"] - 1) // seq
    # the test windows are exactly the test documents, each followed by <|endoftext|>
    stream = np.concatenate([ds.test_x.reshape(-1), ds.test_y[-1:, -1]])
    expected = "".join(d.text + td.EOT for d in split[1])
    assert expected.startswith(td.decode(ds, stream)[:-4])
    assert td.decode(ds, ds.train_x[0]).startswith(split[0][0].text[:20])
    np.testing.assert_array_equal(
        td.pack([np.array([5, 6]), np.array([7])], 0, 2), [[5, 6, 0], [0, 7, 0]]
    )
    with pytest.raises(DataError, match="too long"):
        td.pack([np.array([5])], 0, 4)


def test_cache_reuse_and_corruption(tmp_path, split, monkeypatch):
    cache = tmp_path
    texts = [d.text for d in split[0][:20]]
    first = td.train_tokenizer(texts, 300, cache_dir=cache)
    (path,) = cache.glob("bpe-*.json")
    again = td.train_tokenizer(texts, 300, cache_dir=cache)
    assert (first.origin, again.origin) == ("trained", "cache") and again.json == first.json
    assert not list(cache.glob(".*.tmp"))
    entry = json.loads(path.read_text())
    assert entry["fingerprint"] == first.fingerprint

    def bad_file(text):
        path.write_text(text)
        redo = td.train_tokenizer(texts, 300, cache_dir=cache)
        assert redo.origin == "retrained" and redo.json == first.json
        assert json.loads(path.read_text()) == entry  # replaced by a good file

    def foreign_file(text):  # not a pdjax entry for this key: never rewritten
        path.write_text(text)
        with pytest.warns(UserWarning, match="not a pdjax cache entry"):
            redo = td.train_tokenizer(texts, 300, cache_dir=cache)
        assert redo.origin == "trained" and redo.json == first.json
        assert path.read_text() == text

    edited = entry["tokenizer"].replace('"Ġt', '"Ġq', 1)
    assert edited != entry["tokenizer"]
    bad_file(json.dumps({**entry, "tokenizer": edited}))  # edited, stale fingerprint
    foreign_file(path.read_text()[:1000])  # cut short (pdjax writes whole files)
    fake = {**entry, "tokenizer": edited, "fingerprint": td.tokenizer_fingerprint(edited)}
    foreign_file(json.dumps({**fake, "key": "0" * 64}))  # another key's file under this name
    foreign_file("my notes\n")  # another program's
    path.write_text(json.dumps(entry))

    def no_training(*args):
        raise AssertionError("trained although cached")

    monkeypatch.setattr(td, "_train", no_training)
    assert td.train_tokenizer(texts, 300, cache_dir=cache).origin == "cache"
    with pytest.raises(AssertionError):  # another vocabulary size is another key
        td.train_tokenizer(texts, 301, cache_dir=cache)


def test_fingerprint_mismatch_names_both(ds, cache):
    td.check_tokenizer(ds.info["tokenizer_fingerprint"], ds)
    other = td.text_bpe(seq_len=32, vocab_size=512, cache_dir=cache)
    stored = other.info["tokenizer_fingerprint"]
    assert stored.startswith("sha256:") and stored != ds.info["tokenizer_fingerprint"]
    with pytest.raises(DataError, match="tokenizer mismatch") as err:
        td.check_tokenizer(stored, ds)
    assert stored in str(err.value) and ds.info["tokenizer_fingerprint"] in str(err.value)
    with pytest.raises(DataError, match="no BPE tokenizer"):
        td.check_tokenizer(stored, data.text(seq_len=8))
    assert td.decode(data.text(seq_len=8), np.array([1, 2])) != ""  # char-level decode


def test_bucket_choice_padding_and_batches():
    examples = [np.arange(n + 1, dtype=np.int32) + 10 for n in (3, 4, 5, 8, 1, 7)]
    b = td.bucket_examples(examples, (4, 8), pad_id=1)
    assert b.lengths == (4, 8) and [len(x.inputs) for x in b.buckets] == [3, 3]
    small = b.buckets[0]  # examples 0, 1, 4 in order
    np.testing.assert_array_equal(small.inputs[0], [10, 11, 12, 1])
    np.testing.assert_array_equal(small.targets[0], [11, 12, 13, td.IGNORE])
    np.testing.assert_array_equal(small.targets[2], [11, td.IGNORE, td.IGNORE, td.IGNORE])
    assert b.real_tokens == 3 + 4 + 5 + 8 + 1 + 7 and b.positions == 3 * 4 + 3 * 8
    assert b.padding_fraction == pytest.approx(1 - 28 / 36)
    first = list(b.batches(2, seed=3, epoch=0))
    assert len(first) == b.num_batches(2) == 2
    assert sorted(x.shape[1] for x, _ in first) == [4, 8]  # one bucket per batch
    again = list(b.batches(2, seed=3, epoch=0, start=1))
    np.testing.assert_array_equal(again[0][0], first[1][0])
    assert sum(m.sum() for _, _, m in b.eval_batches(2)) == 6


def test_buckets_refuse_too_long_before_any_work(cache, monkeypatch):
    long = [np.zeros(4, np.int32), np.zeros(10, np.int32)]
    with pytest.raises(DataError, match=r"example 1 has 9 positions.*largest bucket, 8"):
        td.bucket_examples(long, (4, 8), pad_id=1)
    with pytest.raises(DataError, match="strictly ascending"):
        td.bucket_examples(long, (8, 4), pad_id=1)
    calls = []
    monkeypatch.setattr(td, "bucket_examples", lambda *a, **k: calls.append(a))
    with pytest.raises(DataError, match=r"document '.*' has \d+ positions.*largest bucket, 128"):
        td.text_bpe_buckets((64, 128), split_long=False, cache_dir=cache)
    assert not calls


def test_document_buckets_cover_every_token(cache):
    train, test, info = td.text_bpe_buckets((64, 256), cache_dir=cache)
    for b, tokens in ((train, info["train_tokens"]), (test, info["test_tokens"])):
        assert b.real_tokens == tokens  # each document token and its closing EOT, once
        assert 0 < b.padding_fraction < 0.2
        for bucket in b.buckets:
            real = bucket.mask
            # right padding only: once a position is padding, the rest of the row is
            assert (real[:, :-1] | ~real[:, 1:]).all()
    assert info["padding_fraction"]["test"] == test.padding_fraction
    pieces = td.document_examples([np.arange(5, 10)], 0, 3)
    np.testing.assert_array_equal(np.concatenate([p[1:] for p in pieces]), [5, 6, 7, 8, 9, 0])
    assert [len(p) for p in pieces] == [4, 4]
    assert [len(p) for p in td.document_examples([np.arange(5, 11)], 0, 3)] == [4, 4, 2]
