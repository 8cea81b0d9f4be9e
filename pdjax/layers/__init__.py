"""Layer sequences: a model as an ordered list of Flax modules.

A :class:`Layer` is the unit pdjax profiles, partitions and places on devices. It wraps
one Flax module (``flax.linen`` or ``flax.nnx``), or a parameter-free function such as
``nn.relu`` (:class:`FnLayer`), behind two pure functions:

* ``init(rng, x) -> variables``: the layer's variables as a plain dict of collections,
  ``{"params": ..., "batch_stats": ...}``, built from a sample input ``x``;
* ``apply(variables, x, *, train, rng) -> (y, state)``: the output pytree ``y`` and the
  layer's non-parameter collections after the call (BatchNorm statistics updated in train
  mode, unchanged in eval mode).

Activations between layers are arbitrary pytrees: arrays, tuples (seq2seq), dicts.
A :class:`LayerSequence` composes layers; applying it equals applying a monolithic model
built from the same modules in the same order. Each layer owns its parameters: a module
object (or an nnx variable) reachable from two layers is refused, since pdjax would give
each layer its own copy and silently untie them. Parameters that are one, such as an
embedding shared with the output head, are declared with ``tied=`` (see :func:`sequential`):
each layer keeps a copy, and pdjax keeps the copies equal, with the gradient of the one
parameter (the sum of the copies' gradients). ``sequential(..., precision="bf16")``
computes every layer in bfloat16 with float32 parameters (:class:`PrecisionLayer`).

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> seq = sequential(nn.Dense(8), nn.Dense(4))
>>> variables = seq.init(jax.random.key(0), jnp.ones((2, 3)))
>>> y, _ = seq.apply(variables, jnp.ones((2, 3)))
>>> y.shape
(2, 4)

The package's modules: :mod:`~pdjax.layers.base` (the :class:`Layer` protocol and types),
:mod:`~pdjax.layers.linen_layer`, :mod:`~pdjax.layers.nnx_layer`,
:mod:`~pdjax.layers.fn_layer` and :mod:`~pdjax.layers.precision_layer` (the layer kinds),
:mod:`~pdjax.layers.tied` (tied parameters), :mod:`~pdjax.layers.sequence` (the
:class:`LayerSequence`), :mod:`~pdjax.layers.build` (:func:`sequential`,
:func:`as_layer`), the package :mod:`~pdjax.layers.split` (:func:`split_model`: a whole
linen or nnx model cut into layers at submodule calls, its variables kept in the model's
own tree) and
:mod:`~pdjax.layers.init_programs` (initialising on given devices by programs that
identical layers share).
"""

from pdjax.layers.base import Layer, LossFn, PyTree, TiedLeaf, Variables, count_traces
from pdjax.layers.build import as_layer, sequential
from pdjax.layers.fn_layer import Fn, FnLayer
from pdjax.layers.linen_layer import LinenLayer
from pdjax.layers.nnx_layer import NnxLayer
from pdjax.layers.precision_layer import PrecisionLayer
from pdjax.layers.sequence import LayerSequence
from pdjax.layers.split import SplitLayer, SplitLayers, split_model

__all__ = [
    "Fn",
    "FnLayer",
    "Layer",
    "LayerSequence",
    "LinenLayer",
    "LossFn",
    "NnxLayer",
    "PrecisionLayer",
    "PyTree",
    "SplitLayer",
    "SplitLayers",
    "TiedLeaf",
    "Variables",
    "as_layer",
    "count_traces",
    "sequential",
    "split_model",
]
