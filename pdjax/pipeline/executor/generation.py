"""Greedy generation through a pipeline's stages (:meth:`Pipeline.generate`): the
forward of a causal language model in eval mode, repeated once per new token, each
token the argmax of the last position's logits, computed on the last stage and handed
to every process.

There is no key/value cache: every new token runs the whole window (the prompt and the
tokens so far, at most ``context`` of them) through every stage again, forward only.
The window has one length for the whole call (``min(context, prompt + new tokens - 1)``):
shorter sequences are padded on the right and the logits read at their last real
position, so each stage compiles one program per call, not one per length. That reading
is exact for a causal model (its output at position ``i`` depends on tokens ``0..i``
only), which is what a language model is; a model that looks ahead would see the
padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.errors import PdjaxError, PipelineError
from pdjax.pipeline.executor.config import integer

if TYPE_CHECKING:
    from pdjax.pipeline.executor.forward import Forward
    from pdjax.pipeline.executor.state import PipelineState

__all__ = ["greedy", "prompt_array"]

#: The token the window is padded with on the right (never read: see the module doc).
PAD = 0


def prompt_array(prompt_tokens: Any) -> np.ndarray:
    """``prompt_tokens`` as an int32 array ``[B, T]``: a 2-D array of integers (or a
    sequence of equal-length token sequences), ``B`` prompts of ``T >= 1`` tokens each.

    Raises:
      PipelineError: for prompts of different lengths (generate each length apart, or
        cut them to one length), or anything that is not one 2-D array of integers.
    """
    if isinstance(prompt_tokens, list | tuple) and prompt_tokens:
        lengths = sorted({len(p) for p in prompt_tokens if hasattr(p, "__len__")})
        if len(lengths) > 1:
            raise PipelineError(
                f"generate takes prompts of one length, got lengths {lengths}: generate each "
                "length apart (the same call batches prompts of equal length), or cut them to "
                "one length"
            )
    try:
        tokens = np.asarray(prompt_tokens)
    except ValueError as e:  # ragged nesting
        raise PipelineError(f"generate takes a 2-D array of token ids [B, T]: {e}") from e
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise PipelineError(
            "generate takes the prompts as a 2-D array of integer token ids [B, T] (one "
            f"prompt: tokens[None]), got {tokens.dtype}{list(tokens.shape)}"
        )
    if tokens.shape[0] < 1 or tokens.shape[1] < 1:
        raise PipelineError(
            f"generate needs at least one prompt of at least one token, got shape "
            f"{list(tokens.shape)}"
        )
    if tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max:
        raise PipelineError(
            f"token ids must be in [0, 2**31), got {tokens.min()} .. {tokens.max()}"
        )
    return tokens.astype(np.int32)


def next_token(logits: jax.Array, position: jax.Array) -> jax.Array:
    """The greedy next token of each row: the argmax of ``logits[:, position]`` (ties:
    the lowest id), int32 ``[B]``."""
    last = jax.lax.dynamic_index_in_dim(logits, position, axis=1, keepdims=False)
    return jnp.argmax(last, axis=-1).astype(jnp.int32)


def greedy(
    forward: Forward,
    state: PipelineState,
    prompt_tokens: Any,
    max_new_tokens: int,
    *,
    context: int | None = None,
) -> np.ndarray:
    """Greedy decoding of ``max_new_tokens`` tokens after ``prompt_tokens`` through the
    pipeline's stages (see the module): the prompts followed by the new tokens, int32
    ``[B, T + max_new_tokens]`` on the host, the same on every process.

    ``context`` (None: every token is kept) is the most tokens the model is fed: past it
    the window slides, keeping the last ``context`` tokens, as nanoGPT's ``sample``
    does (a model with absolute positions then sees them shifted). Without it, the
    prompt and the new tokens must fit the model at once, which is checked on shapes
    before any device work.

    Raises:
      PipelineError: before any device work, for prompts that are ragged or not token
        ids (:func:`prompt_array`), a ``max_new_tokens`` or ``context`` that is not a
        whole number (>= 0, >= 1), a window the model cannot take (pass ``context=``, the
        model's context length, to slide), a model whose eval outputs are not logits
        ``[B, T, V]``, or a token id past the vocabulary (``>= V``: an embedding would
        read past its table, which JAX clamps or fills, silently).
    """
    tokens = prompt_array(prompt_tokens)
    new = integer("max_new_tokens", max_new_tokens, 0)
    if context is not None:
        context = integer("context", context, 1)
    b, t0 = tokens.shape
    longest = t0 + new - 1  # the last token is read off the sequence before it
    # no new token: nothing is fed; one token's window still gives the vocabulary
    width = 1 if new == 0 else longest if context is None else min(context, longest)
    window = np.zeros((b, width), np.int32)
    try:
        spec = forward.output_spec(state, window)
    except PdjaxError as e:  # the model's own refusal (a LayerError), or the checks'
        hint = (
            ""
            if context is not None or new == 0
            else " (pass context=, the model's context length, to slide a window of at "
            "most that many tokens)"
        )
        fed = (
            "reads the model's vocabulary off a window of 1 token"
            if new == 0
            else f"feeds the model windows of {width} tokens (the prompt's {t0} and "
            f"{new - 1} of the {new} new ones)"
        )
        raise PipelineError(f"generate {fed}, which it does not take{hint}: {e}") from e
    shape = getattr(spec, "shape", None)
    if shape is None or len(shape) != 3 or tuple(shape[:2]) != (b, width) or shape[2] < 1:
        raise PipelineError(
            "generate needs a causal language model, token ids [B, T] -> logits [B, T, V]; "
            f"for inputs int32{[b, width]} this model's outputs are "
            f"{jax.tree.map(lambda a: f'{a.dtype}{list(a.shape)}', spec)}"
        )
    vocabulary = int(shape[2])  # the tokens the model scores, every one it can be fed
    if tokens.max() >= vocabulary:
        bad = np.argwhere(tokens >= vocabulary)[0]
        raise PipelineError(
            f"token ids must be in [0, {vocabulary}), the model's vocabulary (the width of "
            f"its logits), got {tokens[tuple(bad)]} at prompt {bad[0]}, position {bad[1]} "
            f"(ids up to {tokens.max()}): encode the prompts with the model's own tokenizer"
        )
    if new == 0:
        return tokens
    seq = np.zeros((b, t0 + new), np.int32)
    seq[:, :t0] = tokens
    for t in range(t0, t0 + new):  # seq[:, :t] is known
        lo = max(0, t - width)
        window = np.full((b, width), PAD, np.int32)
        window[:, : t - lo] = seq[:, lo:t]
        (token,) = forward.collect(state, [window], next_token, [np.int32(t - lo - 1)])
        seq[:, t] = token
    return seq
