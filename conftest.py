"""Test set-up for tests/ and the doctests in pdjax/: 8 simulated CPU devices, strict
numerics, set before any JAX operation."""

import os
import subprocess
import sys

import jax

# XLA's backend (LLVM) at its lowest optimization level, here and in every process a test
# starts: compiling is most of this suite's time, and these tiny programs run about as
# fast either way. XLA's graph passes (fusion, layouts, simplification) are unchanged, so
# the programs compute the same operations; the tests marked ``xla_optimized`` (in
# tests/test_pipeline.py, tests/xla_cache.py) compile at the default level, as users'
# programs do. ``JAX_DISABLE_MOST_OPTIMIZATIONS=0 make test`` runs everything at it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
jax.config.update(
    "jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] != "0"
)

# XLA's CPU backend generates the code of its fusions along its classic path, not through
# its newer MLIR fusion emitters: about a third less compile time on these models. The
# fused HLO is the same; only the code generator differs. A jaxlib that no longer knows
# the flag would abort on it, so it is tried once in a throwaway process first (and the
# xdist workers inherit the answer). ``PDJAX_TEST_CLASSIC_FUSIONS=0`` keeps the default.
_CLASSIC_FUSIONS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()}
    try:
        done = subprocess.run(probe, env=env, capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


if os.environ.setdefault("PDJAX_TEST_CLASSIC_FUSIONS", "1") == "1" and _CLASSIC_FUSIONS not in (
    os.environ.get("XLA_FLAGS", "")
):
    if _xla_accepts(_CLASSIC_FUSIONS):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_CLASSIC_FUSIONS}".strip()
    else:
        os.environ["PDJAX_TEST_CLASSIC_FUSIONS"] = "0"  # this jaxlib: its default emitters
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
# Random-number kernels compile several times faster without the partitionable threefry
# (seconds per model on CPU); the tests need fixed streams, not that layout property.
jax.config.update("jax_threefry_partitionable", False)

# tests/ is on the path through pytest's `pythonpath` (pyproject.toml): reference.py, and
# the shared fixtures and set-up in tests/user_model.py, xla_cache.py and tiers.py
pytest_plugins = ["user_model", "xla_cache", "tiers"]

# CI lands a change only on a passing run: there the property tests draw the same examples
# every time (a failure they can find is found on every run, not by chance).
try:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")
except ImportError:  # hypothesis is a test extra
    pass
