"""Greedy generation through a pipeline's stages (:meth:`Pipeline.generate`): the
forward of a causal language model in eval mode, repeated once per new token, each
token the argmax of the last position's logits, computed on the last stage and handed
to every process.

:func:`generate` chooses the path: with a key/value cache
(:mod:`.cached_generation`: the prompt once, then one position per token) where the
model supports it and the cache gives the tokens this module's path gives, else this
module's :func:`greedy`, whose choice it says once per pipeline and reason (a warning on
the ``pdjax`` logger; ``cache=True`` refuses instead). The cache cannot reproduce a
window that slides (each token would then see its neighbours' positions shifted), so
the new tokens of a call fed past ``context`` run uncached (those before them with the
cache); a pipeline across processes runs uncached.

:func:`greedy` has no key/value cache: every new token runs the whole window (the prompt
and the tokens so far, at most ``context`` of them) through every stage again, forward
only.
The window has one length for the whole call (``min(context, prompt + new tokens - 1)``):
shorter sequences are padded on the right and the logits read at their last real
position, so each stage compiles one program per call, not one per length. That reading
is exact for a causal model (its output at position ``i`` depends on tokens ``0..i``
only), which is what a language model is; a model that looks ahead would see the
padding.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.errors import PdjaxError, PipelineError
from pdjax.pipeline.executor.config import integer

if TYPE_CHECKING:
    from pdjax.pipeline.executor.forward import Forward
    from pdjax.pipeline.executor.state import PipelineState

__all__ = ["generate", "greedy", "prompt_array"]

#: The token the window is padded with on the right (never read: see the module doc).
PAD = 0

#: Where a call that runs without the cache it could have used says so.
LOG = logging.getLogger("pdjax")


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
    tokens, new, width = checked(forward, state, prompt_tokens, max_new_tokens, context)
    if new == 0:
        return tokens
    return _uncached(forward, state, tokens, new, width)


def checked(
    forward: Forward,
    state: PipelineState,
    prompt_tokens: Any,
    max_new_tokens: Any,
    context: Any,
) -> tuple[np.ndarray, int, int]:
    """What :func:`greedy` refuses before any device work (see its Raises), and what it
    then runs on: the prompts as int32 ``[B, T]``, the new tokens, and the width of the
    window it feeds (the prompt and every new token but the last, at most ``context``)."""
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
    return tokens, new, width


def _uncached(
    forward: Forward, state: PipelineState, tokens: np.ndarray, new: int, width: int
) -> np.ndarray:
    """:func:`greedy`'s loop: ``new >= 1`` tokens, each rerunning the window."""
    b, t0 = tokens.shape
    seq = np.zeros((b, t0 + new), np.int32)
    seq[:, :t0] = tokens
    for t in range(t0, t0 + new):  # seq[:, :t] is known
        lo = max(0, t - width)
        window = np.full((b, width), PAD, np.int32)
        window[:, : t - lo] = seq[:, lo:t]
        (token,) = forward.collect(state, [window], next_token, [np.int32(t - lo - 1)])
        seq[:, t] = token
    return seq


def generate(
    forward: Forward,
    state: PipelineState,
    prompt_tokens: Any,
    max_new_tokens: int,
    *,
    context: int | None = None,
    cache: bool | Literal["auto"] = "auto",
    microbatches: int = 1,
) -> np.ndarray:
    """Greedy decoding as :func:`greedy` (the same tokens, the same refusals), with a
    key/value cache where it applies (see the module).

    Args:
      cache: ``"auto"``: with the cache where the model supports it in a single process
        (past ``context``, where the window slides, the remaining tokens as
        :func:`greedy` does), else :func:`greedy`, said once per pipeline and reason on
        the ``pdjax`` logger; ``True``: every token with the cache, or refused;
        ``False``: :func:`greedy`.
      microbatches: the row blocks the ``B`` prompts are cut into for the cached path
        (``1 <= microbatches <= B``), so that the stages overlap; the uncached path runs
        the whole batch at once.

    Raises:
      PipelineError: as :func:`greedy`; for a ``cache`` or ``microbatches`` that is not
        one of the above; with ``cache=True``, where the cache does not apply (the
        reason, and ``cache="auto"`` or ``False`` to run uncached).
    """
    if not isinstance(cache, bool | str) or cache not in (True, False, "auto"):
        raise PipelineError(f"cache must be True, False or 'auto', got {cache!r}")
    tokens, new, width = checked(forward, state, prompt_tokens, max_new_tokens, context)
    b, t0 = tokens.shape
    m = integer(
        "microbatches",
        microbatches,
        1,
        b,
        f": generate cuts the {b} prompts into that many row blocks, at least one row each",
    )
    if new == 0:
        return tokens
    if cache is False:
        return _uncached(forward, state, tokens, new, width)
    length = t0 + new - 1
    # the new tokens fed windows that do not slide yet (all of them, unless past context)
    fit = new if width >= length else width - t0 + 1
    why: str | None = None
    if forward.stage_set.multiprocess:
        why = "the pipeline spans processes (the cached path runs in one process)"
    elif fit < 1:
        why = (
            f"the prompt's {t0} tokens exceed context={context}: the window slides from "
            "the first new token, which a cache cannot reproduce"
        )
    elif fit < new and cache is True:
        why = (
            f"the {t0} prompt tokens and {new} new ones feed {length} positions, past "
            f"context={context}: the window slides, which a cache cannot reproduce"
        )
    else:
        gen = forward.cached_generation()
        why = gen.unsupported(state, -(-b // m), t0, t0 + fit - 1)
        if why is None and b % m:  # the shorter microbatches too
            why = gen.unsupported(state, b // m, t0, t0 + fit - 1)
        if why is None:
            seq = gen.run(state, tokens, fit, m)
            if fit == new:
                return seq
            _say_once(
                forward,
                f"generate runs the new tokens whose window slides past context={context} "
                "without a key/value cache (a cache cannot reproduce a sliding window); the "
                "tokens before them use it",
            )
            return _uncached(forward, state, seq, new - fit, width)
    if cache is True:
        raise PipelineError(
            f"generate with cache=True: {why}; pass cache='auto' (or False) to generate "
            "without the cache"
        )
    _say_once(forward, f"generate runs without a key/value cache: {why}")
    return _uncached(forward, state, tokens, new, width)


def _say_once(forward: Forward, note: str) -> None:
    """``note`` on the ``pdjax`` logger, the first time this pipeline has it to say (a
    note the output does not depend on: the tokens are the uncached path's either way)."""
    if note not in forward.generation_notes:
        forward.generation_notes.add(note)
        LOG.warning(note)
