"""Stage executables: one stage's jitted forward, backward and update on its devices.

A stage is a contiguous run of layers placed on a device group of ``r`` devices. Its
batch dimension is sharded ``r`` ways over a one-axis ``Mesh`` (``"data"``) and its
weights are replicated, so a replicated stage is data parallel and XLA inserts the
gradient all-reduce; ``r = 1`` is a single device.

Residuals without weight copies: ``jit`` never passes an input through as an output, so
returning ``jax.vjp``'s residuals from a jitted forward would copy the stage's weights
and input for every microbatch. While tracing the forward, pdjax notes which residual
leaves *are* a weight or the input (by identity), returns only the others, and the
backward rebuilds the VJP from the weights and input it is handed again (the stashed
version). With ``remat=True`` the forward keeps nothing and the backward recomputes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdjax._sharding import place
from pdjax.layers import Layer, LossFn, PyTree, Variables, count_traces

__all__ = ["LossFn", "Stage"]


#: ``(base key, microbatch number)``: microbatch ``k`` draws from ``fold_in(key, k)``.
_Rng = tuple[jax.Array, jax.Array]


def _float(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


@dataclasses.dataclass
class _ResidualLayout:
    """How to rebuild a VJP from (weights, input) and the residuals the forward returned."""

    treedef: Any
    sources: list[int | None]  # per VJP leaf: index into flat (params, x) leaves, or None


class Stage:
    """The compiled functions of one pipeline stage.

    Args:
      index: the stage number ``s`` (0-based).
      layers: the stage's layers, in order.
      first_layer: the index of ``layers[0]`` in the whole model (for per-layer RNG
        streams: layer ``i`` of the model always draws from ``fold_in(rng, i)``).
      devices: the stage's device group; the microbatch is split over them.
      optimizer: the optax transformation applied to this stage's parameters.
      loss_fn: the loss, on the last stage only.
      train: training-mode forward (dropout, BatchNorm batch statistics).
      remat: recompute the forward in the backward instead of keeping residuals.

    All functions are jitted once per input shape; ``trace_counts`` counts the traces.
    """

    def __init__(
        self,
        index: int,
        layers: Sequence[Layer],
        first_layer: int,
        devices: Sequence[jax.Device],
        optimizer: optax.GradientTransformation,
        loss_fn: LossFn | None = None,
        *,
        train: bool = True,
        remat: bool = False,
    ) -> None:
        self.index = index
        self.layers = tuple(layers)
        self.first_layer = first_layer
        self.devices = tuple(devices)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.is_last = loss_fn is not None
        self.train = train
        self.remat = remat
        self.mesh = Mesh(np.asarray(self.devices), ("data",))
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self.trace_counts: dict[str, int] = {}
        self._layout: dict[Any, _ResidualLayout] = {}
        self.forward = jax.jit(count_traces(self.trace_counts, "forward", self._forward))
        # the gradient accumulator is donated: adding into it reuses its buffers
        self.backward = jax.jit(
            count_traces(self.trace_counts, "backward", self._backward),
            static_argnums=(5,),
            donate_argnums=(4,),
        )
        self.backward_recompute = jax.jit(
            count_traces(self.trace_counts, "backward_recompute", self._backward_recompute),
            static_argnums=(5,),
            donate_argnums=(4,),
        )
        # the optimizer state is never stashed: update it in place
        self.update = jax.jit(
            count_traces(self.trace_counts, "update", self._update), donate_argnums=(2,)
        )
        # a backward whose gradient goes straight into an update (a window of one
        # microbatch: PipeDream, or M = 1), in one program: no accumulator, and XLA fuses the
        # optimizer into the gradient computation. The newest weights are donated too when
        # nothing reads them after this backward (``backward_update_newest``).
        # (weights and optimizer state stay replicated: XLA would otherwise carry the batch
        # sharding of the gradient computation into them)
        outs = (self.replicated, self.replicated, self.batch_sharding)
        self.backward_update = jax.jit(
            count_traces(self.trace_counts, "backward_update", self._backward_update),
            donate_argnums=(5,),
            out_shardings=outs,
        )
        self.backward_update_newest = jax.jit(
            count_traces(self.trace_counts, "backward_update", self._backward_update_newest),
            donate_argnums=(0, 4),
            out_shardings=outs,
        )

    @property
    def num_replicas(self) -> int:
        return len(self.devices)

    # -- the stage's function -------------------------------------------------------------

    def _apply(
        self, params: list[PyTree], state: list[Variables], x: PyTree, rng: _Rng
    ) -> tuple[PyTree, list[Variables]]:
        key, mb = rng
        rng = jax.random.fold_in(key, mb)  # inside jit: no separate dispatch per microbatch
        new_state = []
        for j, layer in enumerate(self.layers):
            variables = {**state[j], "params": params[j]}
            r = jax.random.fold_in(rng, self.first_layer + j)
            x, s = layer.apply(variables, x, train=self.train, rng=r)
            new_state.append(s)
        return x, new_state

    def _objective(
        self,
        params: list[PyTree],
        x: PyTree,
        state: list[Variables],
        rng: _Rng,
        targets: PyTree,
    ) -> tuple[PyTree, list[Variables]]:
        y, new_state = self._apply(params, state, x, rng)
        if self.loss_fn is not None:
            y = self.loss_fn(y, targets)
        return y, new_state

    def _vjp(
        self,
        params: list[PyTree],
        x: PyTree,
        state: list[Variables],
        rng: _Rng,
        targets: PyTree,
    ) -> tuple[PyTree, Any, list[Variables]]:
        def f(params: list[PyTree], x: PyTree) -> tuple[PyTree, list[Variables]]:
            return self._objective(params, x, state, rng, targets)

        y, pullback, new_state = jax.vjp(f, params, x, has_aux=True)
        return y, pullback, new_state

    # -- jitted bodies ----------------------------------------------------------------------

    def _forward(
        self,
        params: list[PyTree],
        state: list[Variables],
        x: PyTree,
        rng: _Rng,
        targets: PyTree,
    ) -> tuple[PyTree, list[Variables], list[jax.Array]]:
        """``-> (output or loss, new state, residuals without weight or input copies)``."""
        if self.remat:
            y, new_state = self._objective(params, x, state, rng, targets)
            return y, new_state, []
        y, pullback, new_state = self._vjp(params, x, state, rng, targets)
        leaves, treedef = jax.tree.flatten(pullback)
        inputs = {id(leaf): k for k, leaf in enumerate(jax.tree.leaves((params, x)))}
        sources = [inputs.get(id(leaf)) for leaf in leaves]
        kept = [leaf for leaf, src in zip(leaves, sources, strict=True) if src is None]
        self._layout[self._key(params, x, kept)] = _ResidualLayout(treedef, sources)
        return y, new_state, kept

    def _backward(
        self,
        params: list[PyTree],
        x: PyTree,
        residuals: list[jax.Array],
        ct: PyTree,
        acc: list[PyTree] | None,
        want: str,
    ) -> tuple[list[PyTree] | None, PyTree | None]:
        """``-> (parameter gradients, input gradient)`` from the forward's residuals.

        ``want`` picks "both", "input" (zero-bubble's I) or "weights" (its W); XLA drops
        the unrequested half. ``params`` and ``x`` must be the ones the forward used. The
        parameter gradients are added to ``acc`` when it is given (gradient accumulation
        in the same dispatch; pass None with ``want="input"``).
        """
        layout = self._layout[self._key(params, x, residuals)]
        flat_inputs = jax.tree.leaves((params, x))
        it = iter(residuals)
        leaves = [next(it) if src is None else flat_inputs[src] for src in layout.sources]
        return self._pick(jax.tree.unflatten(layout.treedef, leaves), ct, acc, want)

    def _backward_recompute(
        self,
        params: list[PyTree],
        x: PyTree,
        ct: PyTree,
        extras: tuple[list[Variables], _Rng, PyTree],
        acc: list[PyTree] | None,
        want: str,
    ) -> tuple[list[PyTree] | None, PyTree | None]:
        """The backward at ``params`` by recomputing the forward from the saved input
        (``extras`` = the forward's model state, RNG and targets): rematerialisation, and
        PipeDream without weight stashing (newest weights, old input)."""
        state, rng, targets = extras
        _, pullback, _ = self._vjp(params, x, state, rng, targets)
        return self._pick(pullback, ct, acc, want)

    def _pick(
        self, pullback: Any, ct: PyTree, acc: list[PyTree] | None, want: str
    ) -> tuple[list[PyTree] | None, PyTree | None]:
        grad_params, grad_x = pullback(ct)
        if self.index == 0 or want == "weights":
            grad_x = None
        if want == "input":
            grad_params = None
        elif acc is not None:
            grad_params = jax.tree.map(jnp.add, acc, grad_params)
        return grad_params, grad_x

    def _backward_update(
        self,
        params: list[PyTree],
        x: PyTree,
        residuals: list[jax.Array],
        ct: PyTree,
        newest: list[PyTree],
        opt_state: optax.OptState,
    ) -> tuple[list[PyTree], optax.OptState, PyTree | None]:
        """``-> (updated newest weights, optimizer state, input gradient)``: the backward
        of the forward that used ``params``, its gradient (one microbatch's: no scaling)
        applied to ``newest``."""
        grads, grad_x = self._backward(params, x, residuals, ct, None, "both")
        assert grads is not None
        updates, opt_state = self.optimizer.update(grads, opt_state, newest)
        return optax.apply_updates(newest, updates), opt_state, grad_x

    def _backward_update_newest(
        self,
        params: list[PyTree],
        x: PyTree,
        residuals: list[jax.Array],
        ct: PyTree,
        opt_state: optax.OptState,
    ) -> tuple[list[PyTree], optax.OptState, PyTree | None]:
        """:meth:`_backward_update` when the forward used the newest weights."""
        return self._backward_update(params, x, residuals, ct, params, opt_state)

    def _update(
        self,
        grads: list[PyTree],
        params: list[PyTree],
        opt_state: optax.OptState,
        scale: jax.Array,
    ) -> tuple[list[PyTree], optax.OptState]:
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @staticmethod
    def _key(params: list[PyTree], x: PyTree, residuals: list[Any]) -> Any:
        leaves = jax.tree.leaves((params, x, residuals))
        return (jax.tree.structure((params, x)), tuple((a.shape, str(a.dtype)) for a in leaves))

    # -- placement --------------------------------------------------------------------------

    def place_weights(self, tree: PyTree) -> PyTree:
        """Puts weights (or optimizer state) on the stage's devices, replicated. A stage
        spanning processes takes them from this process's copy of the whole value."""
        return place(tree, self.replicated)

    def place_batch(self, tree: PyTree) -> PyTree:
        """Puts an activation or gradient on the stage's devices, batch-sharded (from
        the whole value, when the stage spans processes)."""
        return place(tree, self.batch_sharding)
