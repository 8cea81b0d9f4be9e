"""JAX's persistent compilation cache for the tests: a pytest plugin (see conftest.py),
on for every module unless it is marked ``pytestmark = pytest.mark.no_xla_cache`` (the
modules that count XLA's compilations).

Most of this suite's time is XLA compiling the same small programs again: every test of
the tiny MLP initialises, runs and checks the same stages on the same devices, every
launch of worker processes compiles what the last launch compiled, and each eager
``jnp`` operation on a new shape or device is a program of its own. The cache hands back
the executable of a program compiled before, the same binary, so what a test checks does
not change.

One folder serves the whole run: both pytest-xdist workers, and the processes tests
start (they inherit the ``JAX_*`` variables set here). The cache has no size bound: a
bound makes JAX lock the folder and scan every entry on each write (a third of a second
per write at a few thousand entries). Without the lock, a process may read an entry
another is still writing; JAX then warns and compiles the program itself (pyproject.toml
lets that one warning through). It is switched per module (module scope): a module
marked ``no_xla_cache``, and the processes it starts, compile as they would alone.
``PDJAX_TEST_XLA_CACHE=0`` turns it off (to measure what it saves).

The tests compile with XLA's backend at its lowest optimization level (conftest.py); a
test marked ``xla_optimized`` compiles at the default level instead, as users' programs do.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

#: JAX options while the cache is on (the folder's is set at run time); the same are set
#: as environment variables for the processes tests start.
_OPTIONS: dict[str, str | float | int | None] = {
    "jax_compilation_cache_dir": None,
    "jax_persistent_cache_min_compile_time_secs": 0.0,  # the tiny models compile fast
    "jax_persistent_cache_min_entry_size_bytes": 0,
}


_LOW = "JAX_DISABLE_MOST_OPTIMIZATIONS"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "no_xla_cache: compile without the persistent cache (tests/xla_cache.py)"
    )
    config.addinivalue_line(
        "markers", "xla_optimized: compile at XLA's default optimization level (conftest.py)"
    )


@pytest.fixture(autouse=True)
def xla_optimized(request: pytest.FixtureRequest) -> Iterator[bool]:
    """XLA's default optimization level while a test marked ``xla_optimized`` runs."""
    if request.node.get_closest_marker("xla_optimized") is None:
        yield False
        return
    saved = jax.config.values["jax_disable_most_optimizations"]
    saved_env = os.environ.get(_LOW)
    jax.config.update("jax_disable_most_optimizations", False)
    os.environ[_LOW] = "0"
    try:
        yield True
    finally:
        jax.config.update("jax_disable_most_optimizations", saved)
        if saved_env is None:
            os.environ.pop(_LOW, None)
        else:
            os.environ[_LOW] = saved_env


@pytest.fixture(scope="session")
def _xla_cache_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # base is .../pytest-N/popen-gwK
        base = base.parent
    folder = base / "xla-cache"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="module", autouse=True)
def xla_cache(request: pytest.FixtureRequest, _xla_cache_folder: Path) -> Iterator[Path | None]:
    """The persistent compilation cache, on while the module runs (None where it is off)."""
    off = os.environ.get("PDJAX_TEST_XLA_CACHE") == "0"
    if off or request.node.get_closest_marker("no_xla_cache") is not None:
        yield None
        return
    options = {k: str(_xla_cache_folder) if v is None else v for k, v in _OPTIONS.items()}
    saved = {name: getattr(jax.config, name) for name in options}
    saved_env = {name.upper(): os.environ.get(name.upper()) for name in options}
    compilation_cache.reset_cache()
    for name, value in options.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)
    try:
        yield _xla_cache_folder
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        for var, old in saved_env.items():
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old
        compilation_cache.reset_cache()  # the next module compiles as it would alone
