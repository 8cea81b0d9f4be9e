"""`pdjax train` on a language model: text-bpe data, the masked loss, tokens/s,
perplexity and MFU, bf16, and the tokenizer a checkpoint was trained with."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pdjax.apps.train import TrainConfig, train
from pdjax.apps.train.model_data import build, model_spec, with_precision
from pdjax.apps.train.optimizers import build_optimizer, describe
from pdjax.apps.train.throughput import model_flops_per_sample, peak_flops
from pdjax.errors import PipelineError
from pdjax.layers import sequential
from pdjax.models import CustomModel, get_model
from pdjax.models.spec import as_model_spec
from pdjax.precision import LossScaled

pytest.importorskip("tokenizers")

LM = dict(
    model="llama",
    dataset="text-bpe",
    seq_len=32,
    vocab_size=300,
    batch_size=64,
    microbatches=2,
    devices=2,
    schedule="1f1b",
    plan="even",
    epochs=1,
)


@pytest.fixture(autouse=True, scope="module")
def _tokenizer_cache(tmp_path_factory):
    """The trained tokenizers go to a folder of the tests', not the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


def _small(ds):
    """``ds`` cut to 4 steps of training and one batch of test: these tests check what
    is reported, not how far the model learns."""
    return dataclasses.replace(
        ds,
        train_x=ds.train_x[:256],
        train_y=ds.train_y[:256],
        test_x=ds.test_x[:64],
        test_y=ds.test_y[:64],
    )


def test_masked_loss_is_the_mean_over_kept_targets() -> None:
    spec = get_model("llama", "tiny")
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 5, 64)), jnp.float32)
    targets = rng.integers(0, 64, size=(3, 5)).astype(np.int32)
    targets[0, 3:] = -1
    targets[2, :] = -1
    kept = targets >= 0
    per = optax.softmax_cross_entropy_with_integer_labels(logits[kept], targets[kept])
    np.testing.assert_allclose(spec.loss(logits, targets), per.mean(), rtol=1e-6)
    correct = np.argmax(np.asarray(logits), -1)[kept] == targets[kept]
    np.testing.assert_allclose(spec.accuracy(logits, targets), correct.mean(), rtol=1e-6)
    # no target kept: 0, not NaN
    assert float(spec.loss(logits, np.full((3, 5), -1, np.int32))) == 0.0


def test_model_flops_count_a_dense_layers_matmuls() -> None:
    # forward x @ W (2*i*o per row) and the weight gradient x.T @ g (2*i*o); no input
    # gradient is needed for the first layer's input
    i, o = 256, 512
    spec = as_model_spec(
        CustomModel(
            layers=sequential(nn.Dense(o)),
            loss=lambda out, y: jnp.mean((out - y) ** 2),
            sample_batch=(jnp.ones((4, i)), jnp.ones((4, o))),
        )
    )
    flops = model_flops_per_sample(spec, np.ones((8, i), np.float32), np.ones((8, o), np.float32))
    assert 4 * i * o <= flops <= 4.2 * i * o


def test_cpu_peak_is_measured() -> None:
    peak = peak_flops(jax.devices()[:2])
    assert peak.source.startswith("measured matmul (cpu")
    assert peak.flops > 1e8


def test_llama_on_text_bpe_reports_tokens_perplexity_and_mfu() -> None:
    cfg = TrainConfig(**LM)
    spec, ds = build(cfg)
    assert spec.num_classes == ds.num_classes == 300
    ds = _small(ds)
    assert spec.model_config.seq_len == 32 and ds.train_x.shape[1] == 32
    result = train(cfg, built=(spec, ds), warmup=False)
    (record,) = result.history
    assert record.tokens_per_second == pytest.approx(32 * record.samples_per_second)
    assert record.perplexity == pytest.approx(math.exp(record.test_loss))
    assert record.perplexity < 300  # better than uniform over the vocabulary
    assert ds.info["seq_len"] == 32
    flops = model_flops_per_sample(spec, ds.train_x[:32], ds.train_y[:32])
    peak = peak_flops(jax.devices()[:2])
    # the run's own peak measurement is noisy: the same order of magnitude
    assert 0.2 < record.mfu / (flops * record.samples_per_second / peak.flops) < 5


def test_bf16_model_computes_in_bfloat16() -> None:
    # the pipeline under a policy is tested in test_precision; here: what --precision builds
    cfg = TrainConfig(**{**LM, "precision": "bf16"})
    spec = model_spec(cfg)
    assert spec.layers.precision is not None
    assert spec.layers.precision.compute_dtype == jnp.bfloat16
    plain = model_spec(TrainConfig(**LM))
    assert plain.layers.precision is None
    assert [layer.name for layer in spec.layers.layers] == [
        layer.name for layer in plain.layers.layers
    ]
    assert spec.layers.tied == plain.layers.tied
    x = spec.sample_input(2)
    variables = spec.layers.init(jax.random.key(0), x)
    assert all(
        leaf.dtype == jnp.float32
        for v in variables
        for leaf in jax.tree.leaves(v.get("params", {}))
    )
    hidden, _ = spec.layers.layers[0].apply(variables[0], x)
    assert hidden.dtype == jnp.bfloat16
    out, _ = spec.layers.apply(variables, x)
    assert out.dtype == jnp.float32 and out.shape == (2, 32, 300)
    assert with_precision(spec, "float32") is spec


def test_f16_trains_under_a_loss_scaled_optimizer() -> None:
    cfg = TrainConfig(**{**LM, "precision": "f16", "clip_norm": 1.0})
    spec = model_spec(cfg)
    assert spec.layers.precision.compute_dtype == jnp.float16
    opt = build_optimizer(cfg, 10)
    assert isinstance(opt, LossScaled)
    assert "dynamic loss scaling" in describe(cfg, 10)
    assert not isinstance(build_optimizer(TrainConfig(**LM), 10), LossScaled)


def test_precision_and_vocab_are_checked() -> None:
    with pytest.raises(PipelineError, match="unknown precision 'fp8'"):
        TrainConfig(**{**LM, "precision": "fp8"})
    for schedule in ("pipedream", "2bw", "dp"):
        with pytest.raises(PipelineError, match=f"schedule='{schedule}' cannot do that exactly"):
            TrainConfig(**{**LM, "precision": "f16", "schedule": schedule})
    with pytest.raises(PipelineError, match="allow_stale=True cannot"):
        TrainConfig(**{**LM, "precision": "f16", "schedule": "auto", "allow_stale": True})
    with pytest.raises(PipelineError, match="at least 258"):
        TrainConfig(**{**LM, "vocab_size": 100})
    with pytest.raises(PipelineError, match="drop vocab_size"):
        TrainConfig(**{**LM, "dataset": "text"})
    with pytest.raises(PipelineError, match="text-bpe dataset needs a language model"):
        build(TrainConfig(model="cnn", dataset="text-bpe"))


def test_resume_refuses_another_tokenizer(tmp_path) -> None:
    cfg = TrainConfig(**LM)
    spec, ds = build(cfg)
    ds = _small(ds)
    train(cfg, built=(spec, ds), checkpoint_dir=tmp_path / "ckpt", warmup=False)
    other = dataclasses.replace(ds, info={**ds.info, "tokenizer_fingerprint": "sha256:other"})
    seen: list[str] = []
    with pytest.raises(PipelineError, match=r"trained with tokenizer .* tokenised by sha256:other"):
        train(
            dataclasses.replace(cfg, epochs=2),
            built=(spec, other),
            checkpoint_dir=tmp_path / "ckpt",
            warmup=False,
            on_start=seen.append,
        )
    assert not seen  # refused before the run started


def test_buckets_train_each_batch_at_its_length_and_report_their_padding(monkeypatch):
    from pdjax.pipeline import Pipeline

    lengths = []
    real = Pipeline.run

    def run(self, state, microbatches, **kw):
        lengths.extend(np.shape(x)[1] for x, _ in microbatches)
        return real(self, state, microbatches, **kw)

    monkeypatch.setattr(Pipeline, "run", run)
    said = []
    cfg = TrainConfig(
        **{**LM, "buckets": "32,64,128", "loss_mean": "tokens", "epoch_steps": 3, "batch_size": 8}
    )
    result = train(cfg, on_start=said.append, warmup=False)
    assert "buckets 32,64,128:" in said[0] and "of the training positions are padding" in said[0]
    assert len(lengths) == 6 and set(lengths) <= {32, 64, 128}
    assert lengths[0::2] == lengths[1::2]  # a step's microbatches share its bucket
    assert math.isfinite(result.history[0].train_loss)
    with pytest.raises(PipelineError, match="strictly ascending"):
        TrainConfig(**{**LM, "buckets": "64,32"})
    with pytest.raises(PipelineError, match="keeps the documents of text-bpe apart"):
        TrainConfig(dataset="digits", buckets="8")
    with pytest.raises(PipelineError, match="only buckets vary"):
        TrainConfig(**{**LM, "loss_mean": "tokens"})


def test_a_bucket_too_small_for_a_batch_is_refused_before_any_work():
    cfg = TrainConfig(**{**LM, "buckets": "32,64,128", "batch_size": 64, "epoch_steps": 1})
    with pytest.raises(PipelineError, match=r"bucket 32 \(\d+ examples?\).* never be trained"):
        train(cfg)
