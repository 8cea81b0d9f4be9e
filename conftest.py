"""Test set-up for tests/ and the doctests in pdjax/: 8 simulated CPU devices, strict
numerics, set before any JAX operation."""

import os

import jax

# XLA's backend (LLVM) at its lowest optimization level, here and in every process a test
# starts: compiling is most of this suite's time, and these tiny programs run about as
# fast either way. XLA's graph passes (fusion, layouts, simplification) are unchanged, so
# the programs compute the same operations; tests/test_pipeline.py runs at the default
# level (its ``xla_optimized`` marker, tests/xla_cache.py), as users' programs do.
# ``JAX_DISABLE_MOST_OPTIMIZATIONS=0 make test`` runs everything at the default level.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
jax.config.update(
    "jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] != "0"
)
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
# Random-number kernels compile several times faster without the partitionable threefry
# (seconds per model on CPU); the tests need fixed streams, not that layout property.
jax.config.update("jax_threefry_partitionable", False)

# tests/ is on the path through pytest's `pythonpath` (pyproject.toml): reference.py, and
pytest_plugins = ["user_model", "xla_cache"]  # shared fixtures: tests/user_model.py, xla_cache.py

# CI lands a change only on a passing run: there the property tests draw the same examples
# every time (a failure they can find is found on every run, not by chance).
try:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")
except ImportError:  # hypothesis is a test extra
    pass
