"""JAX's persistent compilation cache for the test modules that build the same programs
again and again (``pdjax train`` end to end, resumed runs, benchmarks): a pytest plugin
(see conftest.py). A module opts in with ``pytestmark = pytest.mark.usefixtures("xla_cache")``.

A fresh pipeline jit-compiles its programs anew, and on CPU XLA's compiler is most of a
short run's time; the cache hands back the executable of a program compiled before, the
same binary, so what a test checks does not change. It is on only while an opted-in
module runs (module scope), so the tests that count XLA's compilations, or that mean to
compile twice, never see it. Each process has its own folder (one per pytest-xdist
worker, under pytest's temporary base): the cache's files are written without locks.
"""

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


@pytest.fixture(scope="session")
def _xla_cache_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xla-cache")


@pytest.fixture(scope="module")
def xla_cache(_xla_cache_folder: Path) -> Iterator[Path]:
    """The persistent compilation cache, on for the module that uses it."""
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
