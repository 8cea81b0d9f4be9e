"""The model and dataset of a run, made to fit each other (:func:`build`), and the checks
of the settings against them and the devices that need no compiling (:func:`check`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pdjax.apps import data as data_lib
from pdjax.apps.data import bpe as text_data
from pdjax.apps.train.config import TOKENS_PREFIX, TrainConfig
from pdjax.apps.train.evaluation import scalar_accuracy
from pdjax.apps.train.optimizers import build_optimizer, run_updates
from pdjax.apps.train.wording import setting
from pdjax.errors import PdjaxError, PipelineError
from pdjax.layers import sequential
from pdjax.models import ModelSpec, get_model, is_model_ref, load_model
from pdjax.schedules import SCHEDULE_KINDS

#: The tokenizer size of a bundled language model trained on ``text-bpe`` (its own
#: vocabulary is replaced by the tokenizer's).
BPE_VOCAB = 1024


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The model of ``cfg``: a bundled one, or a factory's (which gets ``config`` and
    ``seq_len`` if it takes them), under ``cfg.precision``.

    On ``text-bpe`` a bundled language model is built for the tokenizer: its vocabulary
    is ``cfg.vocab_size`` (default :data:`BPE_VOCAB`), its sample windows ``seq_len``
    tokens and its context at least that; on a token file (``tokens:PATH``) alike, for
    the file's vocabulary."""
    if is_model_ref(cfg.model):
        spec = load_model(cfg.model, offer={"config": cfg.config, "seq_len": cfg.seq_len})
    else:
        spec = get_model(cfg.model, cfg.config)
        if cfg.dataset == "text-bpe" and spec.task == "language_model":
            spec = get_model(cfg.model, cfg.config, **_bpe_overrides(cfg, spec))
        elif cfg.dataset.startswith(TOKENS_PREFIX) and spec.task == "language_model":
            from pdjax.apps.data.tokens import declared_vocab_size

            vocab = declared_vocab_size(cfg.dataset[len(TOKENS_PREFIX) :])
            spec = get_model(cfg.model, cfg.config, **_bpe_overrides(cfg, spec, vocab))
    return with_precision(spec, cfg.precision)


def _bpe_overrides(cfg: TrainConfig, spec: ModelSpec, vocab: int | None = None) -> dict[str, Any]:
    """A bundled language model's config fields for ``text-bpe`` (or a token file of a
    vocabulary of ``vocab``)."""
    fields = {f.name for f in dataclasses.fields(spec.model_config)}
    out: dict[str, Any] = {"vocab_size": vocab or cfg.vocab_size or BPE_VOCAB}
    longest = max(cfg.bucket_lengths, default=cfg.seq_len)  # buckets: the largest
    if "seq_len" in fields:
        out["seq_len"] = longest
    if "context" in fields:
        out["context"] = max(spec.model_config.context, longest)
    return {k: v for k, v in out.items() if k in fields}


def with_precision(spec: ModelSpec, precision: str) -> ModelSpec:
    """``spec`` with every layer computing under ``precision`` (``"float32"``: as it is;
    ``"bf16"``: :func:`pdjax.precision.get_policy`), its names and ties kept, and the
    sequence's own kind (:func:`~pdjax.split_model`'s keeps the model's own tree, which the
    optimizer's names come from).

    Raises:
      LayerError: for a model whose layers already compute under a policy of their own.
    """
    if precision == "float32":
        return spec
    layers = spec.layers
    seq = sequential(
        list(layers.layers),
        names=[layer.name for layer in layers.layers],
        tied=dict(layers.tied) or None,
        precision=precision,
    )
    return dataclasses.replace(spec, layers=dataclasses.replace(layers, layers=seq.layers))


def _row_shape(tree: Any, what: str, cfg: TrainConfig) -> tuple[int, ...]:
    leaves = jax.tree.leaves(tree)
    if len(leaves) != 1:
        raise PipelineError(
            f"{cfg.model} takes {what} as {len(leaves)} arrays; the {cfg.dataset} dataset "
            "gives one array"
        )
    return tuple(np.shape(leaves[0])[1:])


def build(cfg: TrainConfig, spec: ModelSpec | None = None) -> tuple[ModelSpec, data_lib.Dataset]:
    """The model and dataset of ``cfg``, made to fit each other.

    A dataset must fit the model's sample batch: the shapes of its rows, and dtypes that
    convert without loss of meaning (:func:`pdjax.apps.data.fit_to_sample`). ``digits`` comes
    as 8x8x1 images or, for a model taking 64 features, flattened.

    Args:
      cfg: the run.
      spec: the model, if already built (default: :func:`model_spec`).

    Raises:
      PipelineError: a model that cannot take the dataset (an image model on text...).
      DataError: a dataset file that is unreadable or does not fit the model.
      LayerError: a model that cannot be built or imported.
    """
    spec = spec if spec is not None else model_spec(cfg)
    custom = spec.task == "custom"
    sample = jax.tree.map(np.asarray, spec.sample_batch(1))
    if cfg.dataset == "digits":
        if not custom and spec.task != "classification":
            raise PipelineError(
                f"{cfg.model} is a {spec.task} model; the digits dataset needs an image or "
                "MLP classifier (cnn, mlp, ...)"
            )
        shape = _row_shape(sample[0], "inputs", cfg)
        if shape not in ((8, 8, 1), (64,)) or (not custom and spec.num_classes != 10):
            raise PipelineError(
                f"{cfg.model} ({cfg.config}) takes inputs {shape}"
                + ("" if custom else f" with {spec.num_classes} classes")
                + "; digits has (8, 8, 1) images (or 64 features, flattened) with 10 "
                f"classes; use {setting('model', 'cnn')} (or mlp) for digits"
                + (", or a model taking (B, 8, 8, 1) or (B, 64)" if custom else "")
            )
        ds = data_lib.digits(seed=cfg.seed, flatten=shape == (64,))
    elif cfg.dataset == "text-bpe":
        if not custom and spec.task != "language_model":
            raise PipelineError(
                f"{cfg.model} is a {spec.task} model; the text-bpe dataset needs a language "
                "model (llama, gpt)"
            )
        vocab = cfg.vocab_size or (spec.num_classes if custom else BPE_VOCAB)
        if custom:
            shape = _row_shape(sample[0], "inputs", cfg)
            if shape != (cfg.seq_len,) or spec.num_classes < 258:
                raise PipelineError(
                    f"{cfg.model}'s sample batch has inputs of rows {shape} and "
                    f"{spec.num_classes} output classes; text-bpe gives windows of "
                    f"{setting('seq_len', cfg.seq_len)} BPE tokens of a vocabulary of its "
                    f"num_classes (at least 258): match {setting('seq_len')} and the model's "
                    "vocabulary"
                )
        if cfg.buckets:
            from pdjax.apps.data.bucket_stream import bucketed_text

            ds, _ = bucketed_text(cfg.bucket_lengths, seed=cfg.seed, vocab_size=vocab)
            return spec, ds
        ds = text_data.text_bpe(seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=vocab)
        if not custom:
            return spec, ds
    elif cfg.dataset == "text":
        if not custom and spec.task != "language_model":
            raise PipelineError(
                f"{cfg.model} is a {spec.task} model; the text dataset needs a language model "
                "(gpt, awd_lm)"
            )
        if custom:
            shape = _row_shape(sample[0], "inputs", cfg)
            if shape != (cfg.seq_len,):
                raise PipelineError(
                    f"{cfg.model}'s sample batch has inputs of rows {shape}; the text dataset "
                    f"gives windows of {setting('seq_len', cfg.seq_len)} tokens, int32 (B, "
                    f"{cfg.seq_len}): match {setting('seq_len')} to the model (a factory "
                    "taking seq_len gets it)"
                )
        ds = data_lib.text(seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=spec.num_classes or None)
        if not custom:  # a bundled language model takes any window up to its context
            return spec, ds
    elif cfg.dataset.startswith(TOKENS_PREFIX):
        return spec, _token_data(cfg, spec, sample)
    else:
        ds = data_lib.load_npz(cfg.dataset)
    return spec, data_lib.fit_to_sample(ds, sample, num_classes=spec.num_classes)


def _validation(cfg: TrainConfig) -> float | str:
    """``cfg.validation`` as :func:`~pdjax.apps.data.tokens.token_dataset` takes it: a
    fraction (default 0.1), or a second token file's path."""
    text = cfg.validation.strip() or "0.1"
    try:
        return float(text)
    except ValueError:
        return text


def _token_data(cfg: TrainConfig, spec: ModelSpec, sample: Any) -> data_lib.Dataset:
    """The windows of ``cfg``'s token file (``tokens:PATH``) for a language model whose
    vocabulary holds the file's, its windows ``seq_len`` tokens."""
    from pdjax.apps.data.tokens import token_dataset

    if spec.task not in ("language_model", "custom"):
        raise PipelineError(
            f"{cfg.model} is a {spec.task} model; a token file needs a language model (llama, gpt)"
        )
    path = cfg.dataset[len(TOKENS_PREFIX) :]
    ds = token_dataset(path, cfg.seq_len, validation=_validation(cfg))
    if ds.num_classes > spec.num_classes:
        raise PipelineError(
            f"{path} holds tokens of a vocabulary of {ds.num_classes} and {cfg.model} "
            f"({cfg.config}) scores {spec.num_classes}: give a model whose vocabulary holds "
            "the file's (a factory of your own, or a config with a larger vocab_size)"
        )
    if spec.task == "custom":
        shape = _row_shape(sample[0], "inputs", cfg)
        if shape != (cfg.seq_len,):
            raise PipelineError(
                f"{cfg.model}'s sample batch has inputs of rows {shape}; the token file gives "
                f"windows of {setting('seq_len', cfg.seq_len)} tokens: match "
                f"{setting('seq_len')} to the model"
            )
    return ds


def check_devices(cfg: TrainConfig) -> None:
    devices = jax.devices()
    if cfg.devices > len(devices):
        kind = devices[0].platform
        raise PipelineError(
            f"{cfg.devices} devices requested, {len(devices)} {kind} device"
            f"{'s' if len(devices) > 1 else ''} visible: pass "
            f"{setting('devices', len(devices))} (or "
            f"fewer), or run where {cfg.devices} are visible. Without an accelerator, "
            # advice to run the command, in its flags, and an XLA flag: not settings
            f"`pdjax train --devices {cfg.devices}` makes {cfg.devices} CPU devices itself; "
            "from Python, set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{cfg.devices} before JAX starts"
        )


# The (settings, model, dataset) triples check() last passed, the objects themselves:
# train() checks a run's settings unless its caller (the command line, which checks every
# variant before the first trains) already did, on these very objects.
_PASSED: list[tuple[TrainConfig, ModelSpec, data_lib.Dataset]] = []
_PASSED_MAX = 16


def check(cfg: TrainConfig, spec: ModelSpec, ds: data_lib.Dataset) -> None:
    """Checks what would fail later without compiling or running anything: sizes against
    the dataset and the devices, the optimizer (a factory of your own is called), the
    schedule and ``min_stages`` against the model's layers, a plan file, and a target
    accuracy for a model without accuracy.

    Raises:
      PipelineError: saying what to change (also: a model whose outputs the dataset's
        labels do not fit, or whose accuracy is not a fraction; :func:`check_model_on_data`).
      PlanError: for an unreadable plan file.
    """
    _check(cfg, spec, ds)
    if not checked(cfg, spec, ds):
        while len(_PASSED) >= _PASSED_MAX:
            _PASSED.pop(0)
        _PASSED.append((cfg, spec, ds))


def checked(cfg: TrainConfig, spec: ModelSpec, ds: data_lib.Dataset) -> bool:
    """Whether :func:`check` passed these very settings, model and dataset (the objects,
    not equal ones) in this process."""
    return any(c is cfg and s is spec and d is ds for c, s, d in _PASSED)


def _check_buckets(cfg: TrainConfig, ds: data_lib.Dataset) -> None:
    """Refuses buckets a step never comes from while they hold examples: a bucket of
    fewer training examples than ``batch_size`` forms no batch (each batch is one
    bucket's), so its examples would never be trained."""
    from pdjax.apps.data.bucket_stream import bucket_counts

    lengths = cfg.bucket_lengths
    counts = bucket_counts(ds, lengths)
    short = [(n, c) for n, c in zip(lengths, counts, strict=True) if 0 < c < cfg.batch_size]
    if short:
        which = ", ".join(f"{n} ({c} example{'s' if c > 1 else ''})" for n, c in short)
        raise PipelineError(
            f"{setting('buckets', cfg.buckets, quote=True)} with "
            f"{setting('batch_size', cfg.batch_size)}: bucket {which} holds fewer training "
            "examples than a batch, and every batch comes from one bucket, so they would "
            f"never be trained; drop {'those buckets' if len(short) > 1 else 'that bucket'} "
            f"(their examples go to the next larger one), or use a smaller "
            f"{setting('batch_size')}"
        )


def _check(cfg: TrainConfig, spec: ModelSpec, ds: data_lib.Dataset) -> None:
    if cfg.batch_size > ds.num_train:
        raise PipelineError(
            f"{setting('batch_size', cfg.batch_size)} is larger than {ds.name}'s "
            f"{ds.num_train} "
            "training samples"
        )
    if cfg.buckets:
        _check_buckets(cfg, ds)
    check_devices(cfg)
    if cfg.target_accuracy is not None and not spec.has_accuracy:
        raise PipelineError(
            f"{setting('target_accuracy')} needs an accuracy, and {spec.name} has none: give "
            "the model an accuracy function (CustomModel(accuracy=...)), or drop "
            f"{setting('target_accuracy')}"
        )
    check_model_on_data(spec, ds)
    from pdjax.apps.train.planning import pass_samples

    build_optimizer(cfg, run_updates(cfg, pass_samples(cfg, ds)))  # a factory's failure, now
    L = len(spec.layers)
    if cfg.min_stages > L:
        raise PipelineError(
            f"{setting('min_stages', cfg.min_stages)}: {spec.name} has {L} "
            f"layer{'s' if L > 1 else ''}, and each stage needs one: pass "
            f"{setting('min_stages', L)} or fewer"
        )
    if cfg.schedule == "dp":
        if cfg.batch_size % cfg.devices:
            raise PipelineError(
                f"data parallelism splits each batch of {cfg.batch_size} over {cfg.devices} "
                f"devices; pick a {setting('batch_size')} that is a multiple of {cfg.devices}"
            )
        return
    kind = SCHEDULE_KINDS.get(cfg.schedule)  # None: auto, resolved later
    if kind is not None and kind.chunks is None:  # the caller's chunks, placed s % P
        if cfg.devices * cfg.chunks > L:
            raise PipelineError(
                f"{kind.name} needs {cfg.devices} devices x {cfg.chunks} chunks = "
                f"{cfg.devices * cfg.chunks} stages of at least one layer; {spec.name} has {L} "
                f"layers: use fewer {setting('devices')} or {setting('chunks')}"
            )
        if cfg.plan not in ("auto", "even") or cfg.straight:
            raise PipelineError(
                f"{kind.name} places equal layer counts, chunk k on device k mod P; it takes "
                f"no {setting('plan')} file and no {setting('straight', True)}"
            )
        return
    if kind is not None and not kind.runs_plan_stages:  # fixed stages per device, a V
        c = kind.default_chunks
        if c * cfg.devices > L:
            raise PipelineError(
                f"{kind.name} places {c} stages per device ({c * cfg.devices} on {cfg.devices} "
                f"devices) and {spec.name} has {L} layers: use fewer {setting('devices')}"
            )
        if cfg.plan not in ("auto", "even") or cfg.straight:
            raise PipelineError(
                f"{kind.name} places equal layer counts in a V (stages d and 2P-1-d on device "
                f"d); it takes no {setting('plan')} file and no {setting('straight', True)}"
            )
        return
    if cfg.plan not in ("auto", "even"):
        from pdjax.partition import Plan

        if not Path(cfg.plan).is_file():
            raise PipelineError(
                # `pdjax plan --out`: advice to run another command, in its own flags
                f"{setting('plan')} takes 'auto', 'even' or a plan JSON file (pdjax plan "
                "--out); "
                f"{cfg.plan!r} is not a file"
            )
        plan = Plan.load(cfg.plan)
        if plan.num_layers != L:
            raise PipelineError(
                f"the plan {cfg.plan} covers {plan.num_layers} layers, {spec.name} has {L}: "
                "make the plan from this model's profile"
            )


# The (spec, dataset) pair check_model_on_data last passed: check() runs once per
# configuration of a command, all on the same model and dataset.
_CHECKED: list[tuple[ModelSpec, data_lib.Dataset]] = []


def check_model_on_data(spec: ModelSpec, ds: data_lib.Dataset) -> None:
    """Checks the model against the dataset on shapes, before anything is compiled: the
    model's outputs for its sample batch (:func:`jax.eval_shape`, no FLOPs), then

    - **labels**: integer targets of the outputs' shape less its last axis are class
      indices into that axis (what a classification or language-model loss takes), so
      every label of both splits must lie in ``[0, width)``; a label past the outputs
      would make the loss NaN (reported as a diverged run) or silently wrong. Float
      targets (regression), targets of the outputs' own shape, and outputs of width 1
      are not class indices and are not checked;
    - **accuracy**: a model's own accuracy function, applied to outputs of zeros and the
      sample's targets, must return one number in ``[0, 1]``.

    A model that cannot take its own sample batch is left to the runner's checks (which
    name the layer).

    Raises:
      PipelineError: naming the model, its output width and the labels' range (or what
        its accuracy returned), and what to change.
    """
    if any(s is spec and d is ds for s, d in _CHECKED):
        return
    x, y = jax.tree.map(np.asarray, spec.sample_batch(2))

    def outputs(x: Any) -> Any:
        variables = spec.layers.init(jax.random.key(0), x)
        return spec.layers.apply(variables, x, train=False)[0]

    try:
        out = jax.eval_shape(outputs, x)
    except Exception:  # the runner's own checks name the layer that fails
        return
    _check_labels(spec, ds, out, y)
    if spec.accuracy_fn is not None:
        _check_accuracy(spec, out, y)
    _CHECKED[:] = [(spec, ds)]


def _check_labels(spec: ModelSpec, ds: data_lib.Dataset, out: Any, y: Any) -> None:
    """The dataset's integer labels against the width of the model's outputs (see
    :func:`check_model_on_data`)."""
    outs, ys = jax.tree.leaves(out), jax.tree.leaves(y)
    if len(outs) != 1 or len(ys) != 1:
        return
    o, t = outs[0], ys[0]
    labels = (ds.train_y, ds.test_y)
    integer = all(a.dtype.kind in "iu" for a in labels)
    if not (integer and jax.numpy.issubdtype(o.dtype, jax.numpy.inexact)):
        return
    if o.ndim < 2 or tuple(o.shape[:-1]) != tuple(np.shape(t)) or o.shape[-1] < 2:
        return
    width = int(o.shape[-1])
    if not all(isinstance(a, np.ndarray) for a in labels):  # a token file's lazy views:
        lo, hi = 0, ds.num_classes - 1  # its reader checks every token against its vocabulary
    else:
        lo = min(int(a.min()) for a in labels if a.size)
        hi = max(int(a.max()) for a in labels if a.size)
        if spec.task == "language_model":  # a negative target is padding, out of the loss
            lo = max(lo, 0)
    if 0 <= lo and hi < width:
        return
    shape = f"{jax.numpy.dtype(o.dtype).name}{list(o.shape)}"
    raise PipelineError(
        f"model {spec.name!r} puts out {width} values per label (its outputs for a sample "
        f"batch of 2 are {shape}) but the {ds.name} dataset's labels range over {lo}..{hi} "
        f"(y_train and y_test): a classification loss would read past the outputs (a NaN "
        f"loss, or a silently wrong one). Give the model {max(hi + 1, 2)} outputs (its last "
        f"layer, e.g. nn.Dense({max(hi + 1, 2)})), or labels in 0..{width - 1}; if the "
        "targets are not class indices (a regression), store them as floats"
    )


def _check_accuracy(spec: ModelSpec, out: Any, y: Any) -> None:
    """The model's own accuracy on outputs of zeros and the sample's targets: one number
    in ``[0, 1]`` (see :func:`check_model_on_data`)."""
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), out)
    try:
        value = spec.accuracy(zeros, y)
    except PdjaxError:
        raise
    except Exception as e:  # the user's function: any error, named
        raise PipelineError(
            f"the accuracy of model {spec.name!r} (CustomModel(accuracy=...)) fails on the "
            f"model's outputs for its sample batch: {type(e).__name__}: {e}; it must take "
            "(outputs, targets) and return one number in [0, 1]"
        ) from e
    fraction = float(scalar_accuracy(spec, value))
    if not 0.0 <= fraction <= 1.0:
        raise PipelineError(
            f"the accuracy of model {spec.name!r} (CustomModel(accuracy=...)) returned "
            f"{fraction!r} for its sample batch (with outputs of zeros); it must return the "
            "fraction correct, in [0, 1] (not a count or a percentage)"
        )
