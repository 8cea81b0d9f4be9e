"""Greedy generation with a key/value cache through a pipeline's stages
(:meth:`Pipeline.generate` with ``cache=True`` or ``"auto"``): the prompts run through
every stage once (the prefill), then each new token runs alone, one position per stage
program, attending over the keys and values the earlier positions left in the cache.

Each stage keeps its own layers' caches on its own devices, per microbatch: its prefill
program allocates them (placed where XLA puts the stage's outputs, beside its eval
inputs and weights) and its decode-step program takes them donated and returns them
written at one more position, so nothing is copied per token. Each stage compiles one
prefill and one decode-step program per call shape (microbatch rows, prompt length,
cache length), never one per token (:attr:`CachedGeneration.traces` says so).

The ``B`` prompts are cut into ``microbatches`` row blocks, dispatched as a wavefront:
stage ``s`` takes microbatch ``k``'s step while stage ``s + 1`` takes ``k - 1``'s, and a
microbatch's next step enters the first stage as soon as the last stage has its token,
which never leaves the devices until the call ends (the argmax is on the last stage, the
token is moved to the first). With at least as many microbatches as stages every stage
has work at every tick; with one, the stages take turns.

Which layers support the cache is asked of the layers themselves, on shapes before any
device work, through the protocol of :mod:`pdjax._decoding`; the Llama family does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax._decoding import CacheStep
from pdjax.layers import PyTree
from pdjax.pipeline.executor.stages import StageSet
from pdjax.pipeline.executor.state import PipelineState
from pdjax.pipeline.executor.trees import abstract

__all__ = ["CachedGeneration", "microbatch_rows"]


class _NoCache(Exception):
    """A layer's answer to a :class:`CacheStep` that is not one (inside a trace)."""


def microbatch_rows(rows: int, microbatches: int) -> list[slice]:
    """The row blocks of ``rows`` prompts cut into ``microbatches`` (as even as can be:
    the first ``rows % microbatches`` blocks one row longer).

    >>> microbatch_rows(5, 2)
    [slice(0, 3, None), slice(3, 5, None)]
    """
    bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(rows), microbatches)])
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


class CachedGeneration:
    """The per-stage prefill and decode-step programs of cached generation, built once
    per pipeline (see the module).

    Attributes:
      traces: per trace of a stage program, ``(kind, stage, input shape, cache
        length)``, ``kind`` ``"prefill"`` or ``"decode"``: a decode step's input is one
        token per row, ``(b, 1)`` tokens on the first stage, ``(b, 1, d)`` activations
        after it, and each program is traced once per call shape.
    """

    def __init__(self, stage_set: StageSet) -> None:
        self.stage_set = stage_set
        self.traces: list[tuple[str, int, tuple[int, ...], int]] = []
        self._programs: dict[tuple[str, int, int], Callable[..., Any]] = {}
        self._support: dict[Any, str | None] = {}

    def unsupported(self, state: PipelineState, rows: int, prompt: int, length: int) -> str | None:
        """Why the model cannot generate with a cache (None: it can), traced on shapes
        (nothing runs): the first layer that does not answer a :class:`CacheStep` with
        one, and what it raised."""
        key = (rows, prompt, length)
        if key in self._support:
            return self._support[key]
        y: Any = jax.ShapeDtypeStruct((rows, prompt), jnp.int32)
        start = jax.ShapeDtypeStruct((), jnp.int32)
        reason = None
        for s, stage in enumerate(self.stage_set.stages):
            fn = self._body(s, length, prefill=True, record=False)
            try:
                y, _ = jax.eval_shape(
                    fn, abstract(state.params[s]), abstract(state.model_state[s]), None, y, start
                )
            except _NoCache as e:
                reason = str(e)
                break
            except Exception as e:  # a layer that does not know the protocol fails its way
                names = [layer.name for layer in stage.layers]
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                reason = (
                    f"stage {s} (layers {', '.join(names)}) does not take a key/value cache "
                    f"step: {type(e).__name__}: {first[:200]}"
                )
                break
        self._support[key] = reason
        return reason

    def run(
        self, state: PipelineState, tokens: np.ndarray, new: int, microbatches: int
    ) -> np.ndarray:
        """The prompts ``tokens`` ``[B, T]`` followed by ``new >= 1`` greedy tokens, int32
        ``[B, T + new]`` on the host (:meth:`unsupported` must have said None for these
        shapes)."""
        stages = self.stage_set.stages
        S = len(stages)
        b, t0 = tokens.shape
        length = t0 + new - 1  # the last new token is never fed
        blocks = microbatch_rows(b, microbatches)
        m = len(blocks)
        n_items = m * new  # item j: microbatch j % m, step j // m (0: the prefill)
        prefill = [self._program(s, length, True) for s in range(S)]
        decode = [self._program(s, length, False) for s in range(S)]
        caches: list[list[Any]] = [[None] * m for _ in range(S)]
        acts: list[dict[int, Any]] = [{} for _ in range(S)]  # stage s's output of item j
        made: list[list[Any]] = [[] for _ in range(m)]  # per microbatch, its tokens on device
        done = [0] * S  # items dispatched per stage
        while done[-1] < n_items:
            for s in reversed(range(S)):  # the wavefront: later stages first, as eval's
                j = done[s]
                if j >= n_items:
                    continue
                k, step = j % m, j // m
                if s > 0 and done[s - 1] <= j:
                    continue  # its input is not dispatched yet
                if s == 0 and step > 0 and done[-1] <= j - m:
                    continue  # its token (the last stage's, one step before) is not either
                stage = stages[s]
                if s == 0:
                    x = tokens[blocks[k]] if step == 0 else acts[S - 1].pop(j - m)
                else:
                    x = acts[s - 1].pop(j)
                x = stage.place_eval(x)
                start = np.int32(0 if step == 0 else t0 + step - 1)
                prog = prefill[s] if step == 0 else decode[s]
                y, caches[s][k] = prog(
                    state.params[s], state.model_state[s], caches[s][k], x, start
                )
                if s == S - 1:
                    made[k].append(y)
                    if step + 1 < new:
                        acts[s][j] = y
                else:
                    acts[s][j] = y
                done[s] += 1
        out = np.zeros((b, t0 + new), np.int32)
        out[:, :t0] = tokens
        got = jax.device_get(made)
        for k, block in enumerate(blocks):
            out[block, t0:] = np.concatenate([np.asarray(t) for t in got[k]], axis=1)
        return out

    def _program(self, s: int, length: int, prefill: bool) -> Callable[..., Any]:
        """Stage ``s``'s jitted prefill or decode-step program for caches of ``length``
        positions: ``(w, st, caches, x, start) -> (y, caches)``, the decode step's caches
        donated (updated in place); on the last stage ``y`` is the greedy token of each
        row, int32 ``(b, 1)``."""
        key = ("prefill" if prefill else "decode", s, length)
        fn = self._programs.get(key)
        if fn is None:
            body = self._body(s, length, prefill=prefill, record=True)
            fn = self._programs[key] = jax.jit(body, donate_argnums=() if prefill else (2,))
        return fn

    def _body(
        self, s: int, length: int, *, prefill: bool, record: bool
    ) -> Callable[..., tuple[Any, list[Any]]]:
        """The traced function of :meth:`_program` (``record``: note each trace in
        :attr:`traces`)."""
        stage = self.stage_set.stages[s]
        last = s == self.stage_set.num_stages - 1
        kind = "prefill" if prefill else "decode"

        def body(
            w: list[PyTree], st: list[PyTree], caches: list[Any] | None, x: Any, start: Any
        ) -> tuple[Any, list[Any]]:
            if record:
                self.traces.append((kind, s, tuple(x.shape), length))
            new_caches = []
            for j, layer in enumerate(stage.layers):
                step = CacheStep(x, start, length, None if caches is None else caches[j])
                out, _ = layer.apply({**st[j], "params": w[j]}, step, train=False)
                if not isinstance(out, CacheStep):
                    raise _NoCache(
                        f"layer {layer.name!r} (stage {s}) does not support a key/value "
                        f"cache: given a CacheStep it returned {type(out).__name__}"
                    )
                x = out.x
                new_caches.append(out.cache)
            if last:  # the greedy token of each row, read at its last position
                x = jnp.argmax(x[:, -1], axis=-1).astype(jnp.int32)[:, None]
            return x, new_caches

        return body
