"""Test set-up: 8 simulated CPU devices, strict numerics, before any JAX operation."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
