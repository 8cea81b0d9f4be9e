"""``pdjax generate``: greedy text from a checkpoint of ``pdjax train``.

pdjax generate --checkpoint runs/llama/ckpt --prompt "def main(" --max-new-tokens 40

The checkpoint's own settings (model, dataset, optimizer: ``pdjax train`` saves them with
every step) rebuild the model and its tokenizer: the characters of ``text``, or the BPE
tokenizer of ``text-bpe``, checked against the fingerprint the checkpoint holds. The
weights are restored into a pipeline of ``--devices`` stages (the checkpoint's own plan
or another: they move layer by layer) and the continuation is decoded greedily through
its stages (:meth:`pdjax.pipeline.Pipeline.generate`, forward only): with a key/value
cache where the model supports it (the prompt through the stages once, then one position
per token), else rerunning the window per token, as ``--no-cache`` always does. Past the
model's ``context`` tokens the window slides over the last ``context``, which a cache
cannot reproduce: such a call runs without it, and says so on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pdjax.apps.commands import (
    MAX_DEVICES,
    HelpFormatter,
    PathOption,
    int_range,
    positive_int,
)
from pdjax.errors import OptionError, PipelineError

__all__ = ["register", "restore_for_generation", "run", "tokenizer_of", "utf8_text"]

#: The most new tokens one call makes (uncached, each reruns the window through every stage).
MAX_NEW_TOKENS = 100_000


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``generate`` subcommand."""
    p = subparsers.add_parser(
        "generate",
        help="greedy text from a checkpoint of pdjax train (a language model)",
        description="Restore a language model trained by 'pdjax train' (its checkpoint "
        "directory) with its tokenizer, and continue --prompt greedily through a pipeline.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # a prefix is refused, not read as an option
    )
    p.add_argument(
        "--checkpoint",
        action=PathOption,
        required=True,
        metavar="DIR",
        help="the --checkpoint-dir of a pdjax train run on text or text-bpe",
    )
    p.add_argument("--prompt", type=utf8_text, required=True, help="the text to continue (UTF-8)")
    p.add_argument(
        "--max-new-tokens",
        action=int_range(0, MAX_NEW_TOKENS, "each reruns the window through every stage"),
        default=50,
        metavar="N",
        help="tokens to generate after the prompt",
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="rerun the whole window through every stage for every new token, without a "
        "key/value cache (the same tokens, slower)",
    )
    p.add_argument(
        "--step",
        action=int_range(0),
        default=None,
        metavar="S",
        help="the checkpoint step (epoch) to restore (default: the newest)",
    )
    p.add_argument(
        "--devices",
        action=positive_int(MAX_DEVICES, "the pipeline's stages, one device each"),
        default=1,
        metavar="N",
        help="pipeline stages, one device each (at most the model's layers)",
    )
    p.set_defaults(func=run)


def utf8_text(text: str) -> str:
    """``--prompt``'s ``type=``: the text, refused (an :class:`OptionError`, while parsing)
    if it holds characters that are not text: bytes of the command line that are not
    UTF-8 (Python keeps each as a lone surrogate, ``abc\\xff`` as ``"abc\\udcff"``) or
    other lone surrogates. A tokenizer reads text, and no guess at another encoding is
    made for it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        code = ord(bad)
        what = (
            f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8,"
            if 0xDC80 <= code <= 0xDCFF
            else f"a lone surrogate U+{code:04X}"
        )
        raise OptionError(
            f"--prompt holds {what} at character {e.start + 1}; give the prompt as UTF-8 "
            "text (e.g. set the terminal's encoding, or write the character itself)",
            "pdjax generate",
        ) from None
    return text


def run(args: argparse.Namespace) -> int:
    """Restores the checkpoint, generates, and prints the prompt and its continuation;
    the training library's messages name flags meanwhile (:mod:`pdjax.apps.train.wording`)."""
    from pdjax.apps.train.wording import command_line

    with command_line():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from pdjax.apps.commands.train import set_cpu_devices

    set_cpu_devices(args.devices)
    folder = Path(args.checkpoint)
    if not folder.is_dir():
        raise PipelineError(
            f"--checkpoint {args.checkpoint}: no such directory; give the --checkpoint-dir "
            "of a pdjax train run"
        )
    pipe, state, spec, ds = restore_for_generation(folder, args.step, args.devices)
    encode, decode = tokenizer_of(ds)
    prompt = encode(args.prompt)
    if prompt.size == 0:
        raise PipelineError("--prompt is empty: give at least one character to continue")
    context = getattr(spec.model_config, "context", None)
    cache = False if args.no_cache else "auto"
    tokens = pipe.generate(state, prompt[None], args.max_new_tokens, context=context, cache=cache)
    sys.stdout.write(args.prompt + decode(tokens[0, prompt.size :]) + "\n")
    return 0


def restore_for_generation(
    folder: Path, step: int | None, devices: int = 1
) -> tuple[Any, Any, Any, Any]:
    """The model of the ``pdjax train`` checkpoint in ``folder`` (``step``, default the
    newest) as ``(pipeline, state, spec, dataset)``: the pipeline over ``devices`` stages
    (at most one per layer), its state restored from the checkpoint (moved layer by layer
    from the run's own plan), the model spec and the dataset that holds its tokenizer.

    Raises:
      CheckpointError: no checkpoint there, or a damaged one.
      PipelineError: a checkpoint without ``pdjax train``'s settings, of data without a
        tokenizer (not ``text`` or ``text-bpe``), or whose tokenizer is not the one made
        here (its fingerprint).
    """
    import jax

    from pdjax.apps.train.config import TrainConfig
    from pdjax.apps.train.model_data import build
    from pdjax.apps.train.optimizers import build_optimizer
    from pdjax.apps.train.resume import refuse_other_data
    from pdjax.pipeline import Pipeline, even_stages
    from pdjax.runners import Checkpointer, DataParallel

    with Checkpointer(folder) as ckpt:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            runs = sorted(
                sub.name
                for sub in Path(folder).iterdir()
                if sub.is_dir() and any(p.name.isdigit() for p in sub.iterdir())
            )
            hint = (
                f": pdjax train keeps each run's checkpoints in a folder of its own, here "
                f"{', '.join(str(Path(folder) / r) for r in runs)}; pass one"
                if runs
                else ""
            )
            raise PipelineError(f"--checkpoint {folder} holds no checkpoint{hint}")
        config = ckpt.extra(step).get("config")
        if not isinstance(config, dict):
            raise PipelineError(
                f"--checkpoint {folder}: step {step} holds no pdjax train settings; "
                "generate reads checkpoints that pdjax train wrote"
            )
        cfg = TrainConfig.from_saved(config)
        spec, ds = build(cfg)
        has_tokenizer = "chars" in ds.info or "tokenizer_json" in ds.info
        if not has_tokenizer:  # a model of one's own on text is a "custom" task: let it be
            raise PipelineError(
                f"--checkpoint {folder} holds a {cfg.model} model trained on {cfg.dataset}, "
                "which has no tokenizer; generate needs a language model trained on text or "
                "text-bpe"
            )
        refuse_other_data(ckpt, step, True, ds)
        layers = len(spec.layers)
        if devices > layers:
            raise PipelineError(
                f"--devices {devices}: the model has {layers} layers, one stage each at most"
            )
        optimizer = build_optimizer(cfg, cfg.warmup_steps + 1)
        sample = np.asarray(ds.train_x[:1])
        rng = jax.random.key(cfg.seed)
        pipe = Pipeline(spec.layers, even_stages(layers, devices), spec.loss, optimizer)
        if cfg.schedule == "dp":  # data parallelism's state: its variables into the stages
            dp = DataParallel(spec.layers, spec.loss, optimizer, devices=jax.devices()[:1])
            saved, _ = ckpt.restore(dp.init(rng, sample), step)
            state = pipe.state_from_variables(dp.variables(saved), rng)
        else:
            state, _ = ckpt.restore(pipe.init(rng, sample), step, pipeline=pipe)
    return pipe, state, spec, ds


def tokenizer_of(ds: Any) -> tuple[Any, Any]:
    """``(encode, decode)`` of a ``text`` or ``text-bpe`` dataset: text to int32 ids
    ``[T]`` (a character outside the vocabulary: its unknown id), ids to text."""
    from pdjax.apps.data import bpe as text_data

    tok_json = ds.info.get("tokenizer_json")
    if tok_json is not None:
        tokenizer = text_data.BPETokenizer(tok_json)
        return (
            lambda text: np.asarray(tokenizer.encode(text), np.int32),
            tokenizer.decode,
        )
    ids = {ch: i for i, ch in enumerate(ds.info["chars"]) if ch}

    def encode(text: str) -> np.ndarray:
        from pdjax.apps.data import UNK

        return np.asarray([ids.get(ch, UNK) for ch in text], np.int32)

    return encode, lambda tokens: text_data.decode(ds, tokens)
