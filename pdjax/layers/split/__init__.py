"""A whole Flax model cut into pdjax layers at named submodules (:func:`split_model`).

Real models are one ``@nn.compact`` body (or a ``setup`` with submodules): an embedding,
a loop over blocks, a final norm, an output head sharing the embedding (``embed.attend``),
glue between the calls (reshapes, masks, positional encodings). :func:`split_model` turns
such a model into a :class:`SplitLayers` (a :class:`~pdjax.layers.LayerSequence`) whose
layers are contiguous ranges of the model's own computation, and whose variables keep the
model's own tree: :meth:`SplitLayers.model_variables` merges per-layer variables (what
``pipe.variables(state)`` returns) into exactly the tree ``model.init`` builds, so
``model.apply(split.model_variables(pipe.variables(state)), x)`` runs the trained model.

How the model is cut, and why that way. The model's ``apply`` is traced to a jaxpr
(``jax.make_jaxpr``) with its variables, inputs and dropout RNG as the jaxpr's inputs,
while ``flax.linen.intercept_methods`` puts an identity marker equation at the start of
every call of a *split unit* (a submodule at the cut level, e.g. each decoder block). The
equations between two cut markers are one layer. A layer's ``apply`` re-traces the model
for the shapes at hand (cached per shape and mode) and evaluates its own equations only:

* it is exact: the jaxpr *is* the model's computation, in the model's order, so every
  piece of glue (reshapes, adds, masks, positional encodings, the final norm, code in the
  parent of the parent) runs once, in the layer where it falls, on real data. Nothing is
  replayed from a recording, and nothing re-runs the parent's Python body with some calls
  skipped (which would need the skipped calls' outputs from somewhere);
* what crosses a cut is found by data flow: the jaxpr values defined before the cut and
  used after it (the activations, a mask built once at the top, positions...), sent as a
  pytree. Values computed from constants alone (a causal mask from shapes) are recomputed
  where used rather than sent;
* which variables a layer holds is found by data flow too: the parameters its equations
  read. A parameter read in two layers (lm1b's shared embedding: ``embed(x)`` in the first,
  ``embed.attend(y)`` in the last) becomes a ``tied=`` group of
  :class:`~pdjax.layers.LayerSequence`, automatically, so its copies stay one parameter;
* dropout draws from the same ``"dropout"`` stream derivation as the whole model (the
  RNG's uses fall inside the submodules' equations); BatchNorm statistics come back as
  the model's own ``mutable`` outputs.

``intercept_methods`` (rather than a module-graph walk) is used because it sees the calls
as they happen, in order, including a second method (``attend``) of a module and modules
defined inline in a compact body. The re-trace per shape needs the model's input shapes
in every layer: each boundary pytree carries, besides the values, a zero-size float array
per model input (``shape + (0,)``: no bytes) from which the shapes are read.

Train/eval: pdjax layers get ``train=True/False``. A model switches dropout and BatchNorm
by a ``__call__`` argument (``train``, ``deterministic``, ...) or by a field
(``TransformerConfig.deterministic``, ``ResNet.train``); ``mode=`` names them (``{"train":
"train"}``: True in train mode; ``{"config.deterministic": "eval"}``: True in eval mode; a
dotted name reaches into dataclass fields), found automatically by default.

What is refused, before any work: an ``at=`` that is neither ``"blocks"`` nor a list of
names, a name that is not a submodule called at one level (the message lists those that
are), a cut inside a transform's body shared with other calls (a scanned stack is one
layer: unroll it to cut between its blocks), cuts out of order or leaving a layer empty,
data-dependent Python control flow, a non-parameter variable (BatchNorm statistics) used
in two layers, which cannot be tied, an input leaf that is no array, and an RNG stream the
model draws from that ``rng_streams=`` does not name. A model of several inputs takes them
as ``model.apply`` does (``split_model(m, tokens, positions, sample_kwargs={...})``); a
module reducing over a named axis (``BatchNorm(axis_name="batch")``) runs with the name
bound to a size-1 axis: each microbatch normalised by its own statistics.

The package's modules: :mod:`~pdjax.layers.split.calls` (the marker, the recorded calls,
the cuts ``at=`` names, the ``mode=`` switch), :mod:`~pdjax.layers.split.cuts` (the jaxpr
cut into layers by data flow) and :mod:`~pdjax.layers.split.linen` (the traced linen model
the layers share), :mod:`~pdjax.layers.split.nnx_model` (the same for an nnx model); this
module holds the layers and :func:`split_model`.

A ``flax.nnx`` model splits the same way (:mod:`~pdjax.layers.split.nnx_model`): traced as
a pure function of its state, cut at the calls of the repeated children of its shallowest
module that has any (``self.embed``, each of ``self.blocks``: ``"blocks/1"``, or
``"decoder/blocks/1"`` inside a child), its variables kept in its own ``nnx.State`` and its RNG
streams reseeded in every layer from the ``rng`` pdjax gives it, never trained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from pdjax.errors import LayerError
from pdjax.layers.base import PyTree, Variables
from pdjax.layers.sequence import LayerSequence
from pdjax.layers.split.calls import check_at, check_streams
from pdjax.layers.split.cuts import leaf_path
from pdjax.layers.split.linen import LinenSplitter
from pdjax.layers.split.nnx_model import NnxSplitter

__all__ = ["SplitLayer", "SplitLayers", "split_model"]


class SplitLayer:
    """One cut of a :func:`split_model` model: the model's equations from one cut
    submodule's first call to the next's (see the module docstring). Its input is the
    model's input (first layer) or the previous cut's boundary pytree, its output the next
    boundary or the model's output (last layer)."""

    def __init__(self, owner: LinenSplitter | NnxSplitter, index: int, name: str) -> None:
        self._owner = owner
        self.index = index
        self.name = name
        #: what profiles and tables call the layer's kind
        self.kind = "split"

    def __repr__(self) -> str:
        return f"SplitLayer(name={self.name!r})"

    @property
    def splitter(self) -> LinenSplitter | NnxSplitter:
        """The traced model this layer is a cut of (shared by the split's layers)."""
        return self._owner

    def init(self, rng: jax.Array, x: PyTree) -> Variables:
        """This layer's share of ``model.init`` for the model input that ``x`` implies."""
        return self._owner.init_cut(self.index, rng, x)

    def apply(
        self,
        variables: Variables,
        x: PyTree,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[PyTree, Variables]:
        """Evaluates this cut's equations; returns the output and the non-parameter
        collections after the call."""
        return self._owner.apply_cut(self.index, variables, x, train, rng)


@dataclasses.dataclass(frozen=True)
class SplitLayers(LayerSequence):
    """The :class:`~pdjax.layers.LayerSequence` of a :func:`split_model` model, with the
    way back to the model's own variable tree.

    Attributes:
      splitter: the traced model its layers share (internal).
    """

    splitter: Any = None

    def model_variables(
        self, variables: Sequence[Variables], *, device: jax.Device | None = None
    ) -> Any:
        """Per-layer variables (``pipe.variables(state)``, ``layers.init(...)``) -> the
        model's own tree, exactly the structure ``model.init`` builds (a tied copy is
        taken from the first layer holding it), on one ``device`` (default: the first),
        for ``model.apply(tree, x)``. For an nnx model: its ``nnx.State`` (its RNG streams
        left out), for ``nnx.update(model, state)``."""
        if len(variables) != len(self.layers):
            raise LayerError(
                f"got variables for {len(variables)} layers, the split has {len(self.layers)}"
            )
        flat: dict[tuple[str, ...], Any] = {}
        for v in variables:
            for path, leaf in jax.tree_util.tree_flatten_with_path(dict(v))[0]:
                flat.setdefault(leaf_path(path), leaf)
        return self.splitter.model_tree(flat, device or jax.devices()[0])

    def layer_variables(self, tree: Any) -> list[Variables]:
        """The inverse of :meth:`model_variables`: the model's tree (``model.init(...)``;
        for an nnx model its ``nnx.state(model)``) as per-layer variables, a tied
        parameter copied to each layer holding it."""
        return [self.splitter.subset(k, tree) for k in range(len(self.layers))]


def split_model(
    model: nn.Module | nnx.Module,
    *sample: PyTree,
    at: str | Sequence[str] | None = "blocks",
    mode: Mapping[str, str] | None = None,
    sample_kwargs: Mapping[str, PyTree] | None = None,
    rng_streams: Sequence[str] = ("dropout",),
) -> SplitLayers:
    """Cuts a whole ``flax.linen`` or ``flax.nnx`` model into pdjax layers at submodule
    calls.

    Args:
      model: the model: linen, unbound (``TransformerLM(config)``, ``ResNet(...)``); or an
        ``nnx.Module``, whose current variables the layers' ``init`` returns.
      sample: the model's positional inputs for one batch, as ``model.apply(variables,
        *sample)`` takes them (usually one array; each a pytree of arrays); only their
        shapes and dtypes are used. A leaf that is no array (a Python list of numbers) is
        refused: convert it with ``jnp.asarray``. The layers (and a pipeline's ``x``) take
        the inputs as one pytree: the input itself where the model takes one; else the
        tuple of the positional inputs, with the dict of ``sample_kwargs`` last where it
        is given (``split_model(m, tokens, positions, sample_kwargs={"mask": m})``: the
        layers take ``(tokens, positions, {"mask": m})``).
      at: where the layers start: ``"blocks"`` (default) cuts before each repeated
        block: the shallowest module that calls two or more submodules of one class, and
        of those the most numerous class (the decoder blocks, wherever they sit); or a list
        of submodule names (``["encoderdecoderblock_2", ...]``, or paths
        ``"decoder/encoderdecoderblock_2"``), children of one parent module, in call
        order. Glue between calls (masks, reshapes, positional encodings, the final norm)
        runs in the layer where it falls; the first layer holds everything before the
        first cut. An nnx model's submodules are its children (``"embed"``,
        ``"blocks/1"``, or the last part alone where it names one).
      mode: how train/eval reaches the model: a bool field (a dotted name reaches into a
        dataclass field: ``"config.deterministic"``) or a ``__call__`` argument, mapped to
        ``"train"`` (True in train mode) or ``"eval"`` (True in eval mode). Default: every
        field or argument named ``train``, ``training`` (``"train"``), ``deterministic``
        or ``use_running_average`` (``"eval"``). ``{}``: the model is left as it is. An
        nnx model is switched by ``model.train()``/``model.eval()`` too, unless ``{}``;
        its ``mode`` names ``__call__`` arguments only.
      sample_kwargs: the model's keyword inputs (arrays, or pytrees of them), as
        ``model.apply(variables, *sample, **sample_kwargs)`` takes them; not one that
        ``mode`` switches.
      rng_streams: the RNG streams a linen model draws from when applied (``"dropout"``,
        a ``self.make_rng("noise")``'s ``"noise"``): each layer derives them all from the
        ``rng`` pdjax gives it (``"dropout"`` is that ``rng``, another stream
        ``fold_in(rng, crc32(name))``); a stream the model draws from and this does not
        name is refused. An nnx model's streams are its own ``nnx.Rngs``, all reseeded.

    Returns:
      A :class:`SplitLayers` (a :class:`~pdjax.layers.LayerSequence`) for
      ``pdjax.Pipeline`` and ``pdjax.profile``; a parameter read in two layers (a shared
      embedding) is tied, and :meth:`SplitLayers.model_variables` merges the layers'
      variables into the model's own tree.

    Raises:
      LayerError: for an ``at`` that is neither ``"blocks"`` nor a list of names, a cut
        name that no submodule has (the message lists those called), a cut inside a
        lifted transform (``nn.scan``: a scanned stack is one layer), cuts of different
        parents, out of order or leaving a layer empty, data-dependent Python control
        flow, a non-parameter variable used in two layers, a ``mode`` naming no field or
        argument, an input leaf that is no array, or an RNG stream the model draws from
        that ``rng_streams`` does not name.

    A module that reduces over a named axis (Flax's ImageNet ``BatchNorm(...,
    axis_name="batch")``, written for ``pmap``) runs with that name bound to an axis of
    size 1: its cross-replica mean is the mean over the call's own batch, so each
    microbatch is normalised by its own statistics (``docs/semantics.md``).

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class MLP(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         for i in range(3):
    ...             x = nn.relu(nn.Dense(4, name=f"dense_{i}")(x)) + 1.0
    ...         return x
    >>> layers = split_model(MLP(), jnp.ones((2, 4)), at=["dense_1"])
    >>> layers.names
    ('00_dense_0', '01_dense_1')
    >>> v = layers.init(jax.random.key(0), jnp.ones((2, 4)))
    >>> y, _ = layers.apply(v, jnp.ones((2, 4)))
    >>> bool(jnp.allclose(y, MLP().apply(layers.model_variables(v), jnp.ones((2, 4)))))
    True
    """
    if isinstance(model, type):
        raise LayerError(f"split_model needs a module instance, {model.__name__}(...)")
    if not isinstance(model, (nnx.Module, nn.Module)):
        raise LayerError(
            f"split_model splits a flax.linen or flax.nnx Module, got {type(model).__name__}"
        )
    check_at(at)
    streams = check_streams(rng_streams)
    splitter: LinenSplitter | NnxSplitter
    if isinstance(model, nnx.Module):
        splitter = NnxSplitter(model, sample, sample_kwargs, at, mode)
    else:
        splitter = LinenSplitter(model, sample, sample_kwargs, at, mode, streams)
    layers = tuple(SplitLayer(splitter, k, name) for k, name in enumerate(splitter.names))
    return SplitLayers(layers, tuple((g, tuple(v)) for g, v in splitter.tied.items()), splitter)
