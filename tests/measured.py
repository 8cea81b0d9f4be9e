"""The runtime's live bytes per device, measured for the memory models' tests, and the
annotated dense layer those tests build models of."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from pdjax.pipeline.executor.interpreter import live_bytes_per_device


def own_buffers(tree):
    """Every array copied into a buffer of its own: an array device_put onto the device it
    was on shares its buffer with the source, which live_arrays() then lists twice."""

    def one(a):
        if not isinstance(a, jax.Array) or jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return a
        return jnp.array(a, copy=True)

    return jax.tree.map(one, tree)


def per_device(arrays):
    """Live bytes per device, each buffer once (the runtime's own count)."""
    return live_bytes_per_device(list(arrays))


def measured_peaks(pipe, state, microbatches):
    """Runs ``microbatches`` through ``pipe`` from ``state`` (its arrays on buffers of their
    own): per device group, the most live bytes the run held on its first device beyond
    what lived there before (other tests' arrays)."""
    state = own_buffers(state)
    others = per_device(jax.live_arrays())
    for device, used in per_device(jax.tree.leaves(state)).items():
        others[device] -= used
    _, metrics = pipe.run(state, microbatches, timeline=True)
    return [
        peak - others.get(pipe.stages[g].devices[0], 0) for g, peak in enumerate(metrics.peak_bytes)
    ]


def megatron_dense(i: int, width: int) -> nn.Dense:
    """Megatron's pairs: (embed, mlp) then (mlp, embed), the bias split as the output."""
    names = ("embed", "mlp") if i % 2 == 0 else ("mlp", "embed")
    return nn.Dense(
        width,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), names),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), names[1:]),
    )
