"""Test set-up for tests/ and the doctests in pdjax/: 8 simulated CPU devices, strict
numerics, set before any JAX operation."""

import gc
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

# Two settings of XLA's CPU compiler that only change how fast it compiles these tiny
# programs on a couple of cores, not what they compute (the optimized HLO is the same):
# - the code of fusions is generated along XLA's classic path, not through its newer MLIR
#   fusion emitters (about a third less compile time on these models);
# - each program's LLVM module is compiled whole rather than split into parts compiled in
#   parallel (the split costs more than it saves on 2 cores: ~13% less CPU time over
#   test_zero_bubble, test_semantics and test_tied).
# A jaxlib that no longer knows a flag would abort on it, so they are tried once in a
# throwaway process first (the xdist workers and the processes tests start inherit the
# answer through XLA_FLAGS). ``PDJAX_TEST_XLA_FLAGS=0`` keeps XLA's defaults.
_TEST_XLA_FLAGS = (
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def _xla_accepts(flags: str) -> bool:
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
    try:
        done = subprocess.run(probe, env=env, capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def _accepted_flags() -> list[str]:
    current = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in _TEST_XLA_FLAGS if f.split("=")[0] not in current]
    if not missing or _xla_accepts(" ".join(missing)):
        return missing
    return [f for f in missing if _xla_accepts(f)]  # this jaxlib drops some: keep the rest


if os.environ.setdefault("PDJAX_TEST_XLA_FLAGS", "1") == "1":
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), *_accepted_flags()]
    ).strip()
    os.environ["PDJAX_TEST_XLA_FLAGS"] = "0"  # decided: the workers inherit XLA_FLAGS as set
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
# Random-number kernels compile several times faster without the partitionable threefry
# (seconds per model on CPU); the tests need fixed streams, not that layout property.
jax.config.update("jax_threefry_partitionable", False)

# The garbage collector's full collections walk every object of the process, and a test
# worker holds a great many (JAX's and XLA's caches of every program it compiled): about
# 5% of a worker's time went to them. Collect less often (the suite's arrays are freed by
# reference counting, not by the collector) and leave the objects made at start-up
# (modules, JAX itself) out of every walk once the tests are collected.
gc.set_threshold(5000, 20, 20)


def pytest_collection_finish(session: object) -> None:
    gc.collect()
    gc.freeze()


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
