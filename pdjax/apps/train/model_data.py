"""The model and dataset of a run, made to fit each other (:func:`build`), and the checks
of the settings against them and the devices that need no compiling (:func:`check`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from pdjax.apps import data as data_lib
from pdjax.apps.train.config import TrainConfig
from pdjax.errors import PipelineError
from pdjax.models import ModelSpec, get_model, is_model_ref, load_model


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The model of ``cfg``: a bundled one, or a factory's (which gets ``config`` and
    ``seq_len`` if it takes them)."""
    if is_model_ref(cfg.model):
        return load_model(cfg.model, offer={"config": cfg.config, "seq_len": cfg.seq_len})
    return get_model(cfg.model, cfg.config)


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
                "classes; use --model cnn (or mlp) for digits"
                + (", or a model taking (B, 8, 8, 1) or (B, 64)" if custom else "")
            )
        ds = data_lib.digits(seed=cfg.seed, flatten=shape == (64,))
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
                    f"gives windows of --seq-len {cfg.seq_len} tokens, int32 (B, "
                    f"{cfg.seq_len}): match --seq-len to the model (a factory taking seq_len "
                    "gets it)"
                )
        ds = data_lib.text(seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=spec.num_classes or None)
        if not custom:  # a bundled language model takes any window up to its context
            return spec, ds
    else:
        ds = data_lib.load_npz(cfg.dataset)
    return spec, data_lib.fit_to_sample(ds, sample, num_classes=spec.num_classes)


def _check_devices(cfg: TrainConfig) -> None:
    devices = jax.devices()
    if cfg.devices > len(devices):
        kind = devices[0].platform
        raise PipelineError(
            f"{cfg.devices} devices requested, {len(devices)} {kind} device"
            f"{'s' if len(devices) > 1 else ''} visible: pass --devices {len(devices)} (or "
            f"fewer), or run where {cfg.devices} are visible. Without an accelerator, "
            f"`pdjax train --devices {cfg.devices}` makes {cfg.devices} CPU devices itself; "
            "from Python, set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{cfg.devices} before JAX starts"
        )


def check(cfg: TrainConfig, spec: ModelSpec, ds: data_lib.Dataset) -> None:
    """Checks what would fail later without compiling or running anything: sizes against
    the dataset and the devices, the schedule against the model's layers, a plan file,
    and a target accuracy for a model without accuracy.

    Raises:
      PipelineError: saying what to change.
      PlanError: for an unreadable plan file.
    """
    if cfg.batch_size > ds.num_train:
        raise PipelineError(
            f"--batch-size {cfg.batch_size} is larger than {ds.name}'s {ds.num_train} "
            "training samples"
        )
    _check_devices(cfg)
    if cfg.target_accuracy is not None and not spec.has_accuracy:
        raise PipelineError(
            f"--target-accuracy needs an accuracy, and {spec.name} has none: give the model "
            "an accuracy function (CustomModel(accuracy=...)), or drop --target-accuracy"
        )
    L = len(spec.layers)
    if cfg.schedule == "dp":
        if cfg.batch_size % cfg.devices:
            raise PipelineError(
                f"data parallelism splits each batch of {cfg.batch_size} over {cfg.devices} "
                f"devices; pick a --batch-size that is a multiple of {cfg.devices}"
            )
        return
    if cfg.schedule == "interleaved":
        if cfg.devices * cfg.chunks > L:
            raise PipelineError(
                f"interleaved needs {cfg.devices} devices x {cfg.chunks} chunks = "
                f"{cfg.devices * cfg.chunks} stages of at least one layer; {spec.name} has {L} "
                "layers: use fewer --devices or --chunks"
            )
        if cfg.plan not in ("auto", "even") or cfg.straight:
            raise PipelineError(
                "interleaved places equal layer counts, chunk k on device k mod P; it takes "
                "no --plan file and no --straight"
            )
        return
    if cfg.schedule == "zb-v":
        if 2 * cfg.devices > L:
            raise PipelineError(
                f"zb-v places 2 stages per device ({2 * cfg.devices} on {cfg.devices} "
                f"devices) and {spec.name} has {L} layers: use fewer --devices"
            )
        if cfg.plan not in ("auto", "even") or cfg.straight:
            raise PipelineError(
                "zb-v places equal layer counts in a V (stages d and 2P-1-d on device d); "
                "it takes no --plan file and no --straight"
            )
        return
    if cfg.plan not in ("auto", "even"):
        from pdjax.partition import Plan

        if not Path(cfg.plan).is_file():
            raise PipelineError(
                f"--plan takes 'auto', 'even' or a plan JSON file (pdjax plan --out); "
                f"{cfg.plan!r} is not a file"
            )
        plan = Plan.load(cfg.plan)
        if plan.num_layers != L:
            raise PipelineError(
                f"the plan {cfg.plan} covers {plan.num_layers} layers, {spec.name} has {L}: "
                "make the plan from this model's profile"
            )
