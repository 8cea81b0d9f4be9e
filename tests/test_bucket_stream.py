"""Sequence-length buckets for training: the bucketed corpus (cropping a row padded to the
largest bucket gives bpe's own bucket padding), the stream of one-bucket batches (bpe's
batch order, any take count, bit-identical resume across passes), the token-weighted loss
against a brute-force token mean, and bad input refused."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.apps.data import Dataset
from pdjax.apps.data import bpe as td
from pdjax.apps.data.bucket_stream import BucketStream, bucketed_text, token_weights
from pdjax.apps.data.stream import split_identity
from pdjax.apps.train.token_loss import token_weighted
from pdjax.errors import DataError
from pdjax.models import get_model

pytest.importorskip("tokenizers")

LENGTHS = (64, 128, 256)
VOCAB = 300


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("tokenizers"))
    return bucketed_text(LENGTHS, seed=0, vocab_size=VOCAB, cache_dir=cache)


@pytest.fixture(scope="module")
def reference(built):
    """The training documents bucketed by bpe's own functions, from the same split and
    tokenizer: ``(Buckets, each document's positions)``."""
    _, info = built
    tok = td.BPETokenizer(info["tokenizer_json"])
    train_docs, _ = td.split_documents(td.documents(), 0, 0.1)
    ids = tok.encode_batch([d.text for d in train_docs])
    examples = td.document_examples(ids, tok.eot_id, LENGTHS[-1])
    buckets = td.bucket_examples(examples, LENGTHS, pad_id=tok.pad_id, vocab_size=tok.vocab_size)
    return buckets, [len(d) + 1 for d in ids]


def _stream(ds, **kw):
    args = {"batch_size": 8, "microbatches": 2, "seed": 3, "identity": split_identity(ds)}
    return BucketStream(ds, LENGTHS, **{**args, **kw})


def _batches(stream, count):
    """``count`` batches of ``stream`` as ``(inputs, targets)``, their microbatches joined
    (each batch's microbatches checked to share one length)."""
    out = []
    for _ in range(count):
        mbs = stream.take(stream.microbatches)
        assert len({x.shape for x, _ in mbs}) == 1
        out.append((np.concatenate([x for x, _ in mbs]), np.concatenate([y for _, y in mbs])))
    return out


def test_cropped_rows_are_bpe_bucket_padding_and_info_counts_them(built, reference):
    ds, info = built
    buckets, doc_positions = reference
    assert ds.name == "text-bpe-buckets" and ds.num_classes == VOCAB
    assert ds.info["tokenizer_fingerprint"] == info["tokenizer_fingerprint"]
    for x, y, split in ((ds.train_x, ds.train_y, "train"), (ds.test_x, ds.test_y, "test")):
        assert x.shape[1] == y.shape[1] == LENGTHS[-1] and x.dtype == y.dtype == np.int32
        positions = (y >= 0).sum(axis=1)
        assert np.array_equal(info["lengths"][split], positions)
        # right padding: real targets fill a prefix; pads fill the rest of the inputs
        prefix = np.arange(LENGTHS[-1]) < positions[:, None]
        assert np.array_equal(y >= 0, prefix)
        assert (x[~prefix] == info["pad_id"]).all()
    positions = info["lengths"]["train"]
    which = np.searchsorted(LENGTHS, positions)
    for i, b in enumerate(buckets.buckets):
        rows = np.flatnonzero(which == i)
        assert len(rows) == len(b.inputs) > 0
        assert np.array_equal(ds.train_x[rows, : b.length], b.inputs)
        assert np.array_equal(ds.train_y[rows, : b.length], b.targets)
    # padding fractions, counted here from the arrays
    pad = info["padding"]
    real = int((ds.train_y >= 0).sum())
    assert pad["one_length"] == pytest.approx(1 - real / ds.train_y.size)
    bucket_len = np.asarray(LENGTHS)[which]
    assert pad["bucketed"] == pytest.approx(1 - real / bucket_len.sum())
    assert pad["bucketed"] < pad["one_length"]
    for i, row in enumerate(pad["buckets"]):
        n = int((which == i).sum())
        assert row["length"] == LENGTHS[i] and row["examples"] == n
        assert row["positions"] == n * LENGTHS[i]
        assert row["real_tokens"] == int(positions[which == i].sum())
    cut = sum(p > LENGTHS[-1] for p in doc_positions)
    assert info["cut_documents"]["train"] == cut > 0
    assert info["longest_document"] >= max(doc_positions)


def test_stream_batches_are_bpe_batches_pass_after_pass(built, reference):
    ds, _ = built
    buckets, _ = reference
    stream = _stream(ds)
    assert stream.batches_per_pass == buckets.num_batches(8)
    assert stream.counts == tuple(len(b.inputs) for b in buckets.buckets)
    got = _batches(stream, 2 * stream.batches_per_pass + 3)
    want = [
        (x, y)
        for epoch in range(3)
        for x, y in buckets.batches(8, seed=3, epoch=epoch)  # cropped by bpe itself
    ][: len(got)]
    assert len(want) == len(got)
    for (gx, gy), (wx, wy) in zip(got, want, strict=True):
        assert np.array_equal(gx, wx) and np.array_equal(gy, wy)
    fresh = _stream(ds)  # length_at tells a microbatch's length without reading it
    assert [fresh.length_at(2 * k + 1) for k in range(len(got))] == [x.shape[1] for x, _ in got]
    # each pass differs (a new shuffle), and each bucket's length occurs
    first = got[: stream.batches_per_pass]
    second = got[stream.batches_per_pass : 2 * stream.batches_per_pass]
    assert any(not np.array_equal(a[0], b[0]) for a, b in zip(first, second, strict=True))
    assert {x.shape[1] for x, _ in first} == {
        b.length for b in buckets.buckets if len(b.inputs) >= 8
    }


def test_any_take_counts_and_skips_give_the_same_stream(built):
    ds, _ = built
    whole = _stream(ds, microbatches=4, batch_size=8, token_weights=True).take(37)
    stream = _stream(ds, microbatches=4, batch_size=8, token_weights=True)
    pieces = []
    for count in (1, 0, 3, 5, 2, 7):
        pieces += stream.take(count)
    stream.skip(4)
    pieces += [None] * 4 + stream.take(15)  # 18 taken, 4 skipped, 15 more
    assert stream.position == 37 == len(pieces)
    assert [stream.length_at(p) for p in range(37)] == [x.shape[1] for x, _ in whole]
    for a, b in zip(whole, pieces, strict=True):
        if b is None:
            continue
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1][0], b[1][0])
        assert np.array_equal(a[1][1], b[1][1])


@pytest.mark.parametrize("token", [False, True])
def test_resume_from_state_is_bit_identical_across_a_pass(built, token):
    ds, _ = built
    original = _stream(ds, token_weights=token)
    per_pass = original.microbatches_per_pass
    original.take(per_pass - 3)  # mid-batch: a batch is 2 microbatches
    saved = json.loads(json.dumps(original.state()))
    resumed = _stream(ds, token_weights=token, state=saved)
    assert resumed.position == original.position == per_pass - 3
    ahead = original.take(9)  # across the pass boundary
    again = resumed.take(9)
    assert {x.shape[1] for x, _ in ahead} and len(ahead) == len(again) == 9
    for (ax, ay), (bx, by) in zip(ahead, again, strict=True):
        assert np.array_equal(ax, bx)
        if token:
            (ay, aw), (by, bw) = ay, by
            assert aw.dtype == np.float32 and aw.shape == (len(ax),)
            assert np.array_equal(aw, bw)
        assert np.array_equal(ay, by)
    assert original.state() == resumed.state()


def test_state_of_other_data_is_refused(built):
    ds, _ = built
    state = _stream(ds).state()
    for change in (
        {"identity": {**state["identity"], "dataset": "text-bpe"}},
        {"seed": 4},
        {"size": 16},
        {"lengths": [64, 256]},
        {"stream": None},
    ):
        with pytest.raises(DataError, match="input state saved with the run is of other data"):
            _stream(ds, state={**state, **change})
    with pytest.raises(DataError, match="valid position"):
        _stream(ds, state={**state, "position": -1})


def _log_softmax(logits):
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_token_weighted_loss_is_the_mean_over_the_batch_real_tokens(built):
    ds, _ = built
    spec = get_model("llama", "tiny")
    loss = token_weighted(spec.loss)
    stream = _stream(ds, batch_size=16, microbatches=4, token_weights=True)
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(stream.batches_per_pass):
        mbs = stream.take(4)
        targets = [t for _, (t, _) in mbs]
        real = [int((t >= 0).sum()) for t in targets]
        if len(set(real)) == 1:  # equal counts: both conventions agree; find a mixed batch
            continue
        weights = [w for _, (_, w) in mbs]  # the microbatch's weight once per row
        assert all(
            w.shape == (len(t),) and len(set(w.tolist())) == 1
            for w, t in zip(weights, targets, strict=True)
        )
        assert [float(w[0]) for w in weights] == [float(w) for w in token_weights(targets)]
        assert sum(float(w[0]) for w in weights) == pytest.approx(4.0)
        # sharper logits in later microbatches: their mean losses differ, so the two
        # conventions differ
        logits = [
            (rng.normal(size=(*t.shape, VOCAB)) * (1 + 3 * m)).astype(np.float32)
            for m, t in enumerate(targets)
        ]
        weighted = np.mean(
            [float(loss(o, (t, w))) for o, (_, (t, w)) in zip(logits, mbs, strict=True)]
        )
        plain = np.mean([float(loss(o, t)) for o, t in zip(logits, targets, strict=True)])
        # brute force: every real token's cross-entropy, summed over the batch
        nll = [
            -np.take_along_axis(_log_softmax(o), np.maximum(t, 0)[..., None], -1)[..., 0][t >= 0]
            for o, t in zip(logits, targets, strict=True)
        ]
        brute = np.concatenate(nll).mean()
        assert weighted == pytest.approx(brute, rel=1e-5)
        assert plain == pytest.approx(np.mean([n.mean() for n in nll]), rel=1e-5)
        assert abs(plain - brute) > 1e-2  # the default differs: a mean of means
        checked += 1
        if checked == 2:
            break
    assert checked == 2
    # plain targets (evaluation's) are the loss itself
    o, t = logits[0], targets[0]
    assert float(loss(o, t)) == float(spec.loss(o, t))


def test_microbatch_without_real_tokens_weighs_zero_and_gives_no_nan():
    spec = get_model("llama", "tiny")
    empty = np.full((2, 8), td.IGNORE, np.int32)
    full = np.arange(16, dtype=np.int32).reshape(2, 8)
    weights = token_weights([empty, full])
    assert [float(w) for w in weights] == [0.0, 2.0]
    assert [float(w) for w in token_weights([empty, empty])] == [0.0, 0.0]
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 32)), jnp.float32)
    loss = token_weighted(spec.loss)
    rows = [jnp.full(2, w) for w in weights]  # once per row, as the stream gives them
    value, grad = jax.value_and_grad(loss)(logits, (jnp.asarray(empty), rows[0]))
    assert (
        float(value) == 0.0 and bool(jnp.isfinite(grad).all()) and float(jnp.abs(grad).max()) == 0
    )
    value = loss(logits, (jnp.asarray(full), rows[1]))
    assert float(value) == pytest.approx(2.0 * float(spec.loss(logits, full)))


def _toy(positions, width=8):
    """Right-padded rows of the given real positions."""
    y = np.full((len(positions), width), td.IGNORE, np.int32)
    for i, p in enumerate(positions):
        y[i, :p] = np.arange(p) + 2
    x = np.where(y >= 0, y, 1).astype(np.int32)
    return Dataset("toy", x, y, x[:1], y[:1], 16)


def test_bad_input_is_refused_naming_what_to_pass():
    ds = _toy([1, 2, 3, 3, 5, 6, 8, 8])
    ident = {"dataset": "toy"}

    def make(lengths=(4, 8), batch_size=2, microbatches=1, data=ds):
        return BucketStream(data, lengths, batch_size, microbatches, seed=0, identity=ident)

    assert make().counts == (4, 4) and make().batches_per_pass == 4
    for lengths in ((8, 4), (4, 4), (0, 8), (4.0, 8)):
        with pytest.raises(DataError, match="bucket length"):
            make(lengths=lengths)
    with pytest.raises(DataError, match=r"4: 4, 8: 4.*at most 4"):
        make(batch_size=5, microbatches=5)
    with pytest.raises(DataError, match="multiple of 3"):
        make(batch_size=4, microbatches=3)
    with pytest.raises(
        DataError, match="more than the largest bucket, 6: pass a bucket of at least 8"
    ):
        make(lengths=(4, 6))
    with pytest.raises(DataError, match="longer than the examples"):
        make(lengths=(4, 16))
    holes = np.array(ds.train_y)
    holes[4, 1] = td.IGNORE  # a padded target before real ones
    with pytest.raises(DataError, match="not padded on the right"):
        make(data=Dataset("toy", ds.train_x, holes, ds.test_x, ds.test_y, 16))
    with pytest.raises(DataError, match="seed"):
        BucketStream(ds, (4, 8), 2, 1, seed=-1, identity=ident)
    with pytest.raises(DataError, match="strictly ascending"):
        bucketed_text((128, 64), seed=0, vocab_size=VOCAB)
