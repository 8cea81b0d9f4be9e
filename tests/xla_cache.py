"""JAX's persistent compilation cache for the test modules: a pytest plugin (see
conftest.py), on for every module unless it is marked
``pytestmark = pytest.mark.no_xla_cache`` (the modules that count XLA's compilations).

Most of this suite's time is XLA compiling the same small programs again: every test of
the tiny MLP initialises, runs and checks the same stages on the same devices, and each
eager ``jnp`` operation on a new shape or device is a program of its own. The cache hands
back the executable of a program compiled before, the same binary, so what a test checks
does not change. It is switched per module (module scope), so a module marked
``no_xla_cache`` compiles as it would alone. Each process has its own folder (one per
pytest-xdist worker, under pytest's temporary base): the cache's files are written
without locks. ``PDJAX_TEST_XLA_CACHE=0`` turns it off (to measure what it saves).
"""

import os
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

_OPTIONS = {
    "jax_compilation_cache_dir": None,  # set to the folder
    "jax_persistent_cache_min_compile_time_secs": 0.0,  # the tiny models compile fast
    "jax_persistent_cache_min_entry_size_bytes": 0,
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "no_xla_cache: compile without the persistent cache (tests/xla_cache.py)"
    )


@pytest.fixture(scope="session")
def _xla_cache_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xla-cache")


@pytest.fixture(scope="module", autouse=True)
def xla_cache(request: pytest.FixtureRequest, _xla_cache_folder: Path) -> Iterator[Path | None]:
    """The persistent compilation cache, on while the module runs (None where it is off)."""
    off = os.environ.get("PDJAX_TEST_XLA_CACHE") == "0"
    if off or request.node.get_closest_marker("no_xla_cache") is not None:
        yield None
        return
    saved = {name: getattr(jax.config, name) for name in _OPTIONS}
    compilation_cache.reset_cache()
    for name, value in _OPTIONS.items():
        jax.config.update(name, str(_xla_cache_folder) if value is None else value)
    try:
        yield _xla_cache_folder
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()  # the next module compiles as it would alone
