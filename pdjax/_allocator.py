"""Fixed glibc allocator thresholds for a training process on CPU.

glibc's ``malloc`` serves a block above its *mmap threshold* by ``mmap`` and below it from
the heap, and by default moves that threshold up to the size of each mmapped block freed
(the *dynamic* threshold), and trims the heap when its free top passes the *trim
threshold*, which moves with it. XLA's CPU buffers are such blocks, so a program's cost
depends on what the process freed before it: a vgg-fc stage's backward measured 18 ms
timed after one stage and 29 ms after another whose large gradients had raised the
threshold. The cluster benchmark's launcher gives every worker fixed thresholds through
the environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, see the
repository's benchmarks/harness/cluster/launcher.py), but glibc reads those when the
process starts: a ``pdjax train`` started by hand sets the same values here through
``mallopt``, which also turns the dynamic threshold off.

:func:`fix_thresholds` does it once per process and returns one line for the run's
report. It leaves alone a threshold the user set (through those variables or
``GLIBC_TUNABLES``), and does nothing, saying why, off glibc on Linux or off CPU.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Callable, Mapping

__all__ = ["ENVIRONMENT", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "fix_thresholds"]

#: Bytes above which a block is mmapped (blocks up to 32 MiB come from the heap).
MMAP_THRESHOLD = 32 << 20
#: Bytes of free heap top above which the heap is trimmed (1 GiB: rarely).
TRIM_THRESHOLD = 1 << 30
#: The same settings as environment variables, read by glibc at process start.
ENVIRONMENT = {
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
}

# mallopt's parameters (glibc's malloc.h), each with its environment variable and tunable
_PARAMETERS = (
    ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold", -3, MMAP_THRESHOLD, "mmap"),
    ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold", -1, TRIM_THRESHOLD, "trim"),
)

#: What :func:`fix_thresholds` did in this process: mallopt's settings are the process's,
#: so a second call (another run of ``pdjax train --compare``) reports the first one's.
_done: str | None = None


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt`` in this process, or None off glibc on Linux."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    fn = getattr(ctypes.CDLL(None), "mallopt", None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return fn  # type: ignore[no-any-return]


def _set_by_user(env: Mapping[str, str], variable: str, tunable: str) -> str | None:
    """How the user set a threshold (``NAME=value``), or None."""
    if variable in env:
        return f"{variable}={env[variable]}"
    for part in env.get("GLIBC_TUNABLES", "").split(":"):
        if part.split("=", 1)[0] == tunable:
            return f"GLIBC_TUNABLES {part}"
    return None


def fix_thresholds(backend: str, env: Mapping[str, str] | None = None) -> str:
    """Fixes glibc's mmap and trim thresholds to :data:`MMAP_THRESHOLD` and
    :data:`TRIM_THRESHOLD` (as the cluster launcher's workers have them), once per process.

    Args:
      backend: the JAX platform the run trains on (``"cpu"``, ``"gpu"``, ...): only CPU
        buffers come from ``malloc``, so elsewhere nothing is changed.
      env: the environment to read the user's own settings from (default ``os.environ``).

    Returns:
      One line for the run's report: what was set, what was kept from the environment, or
      why nothing was done. A later call returns the first call's line and calls
      ``mallopt`` no more.
    """
    global _done
    if _done is not None:
        return _done
    env = os.environ if env is None else env
    if backend != "cpu":
        _done = f"glibc malloc thresholds: not changed (training on {backend}, not cpu)"
        return _done
    mallopt = _mallopt()
    if mallopt is None:
        _done = (
            f"malloc thresholds: not changed ({sys.platform}, "
            f"{platform.libc_ver()[0] or 'unknown libc'}: mallopt is glibc's, on Linux)"
        )
        return _done
    parts = []
    for variable, tunable, param, value, name in _PARAMETERS:
        user = _set_by_user(env, variable, tunable)
        if user is not None:
            parts.append(f"{name} threshold kept as the environment sets it ({user})")
        elif mallopt(param, value) == 1:
            parts.append(f"{name} threshold {value >> 20} MiB")
        else:
            parts.append(f"{name} threshold not changed (mallopt refused {value})")
    _done = "glibc malloc: " + ", ".join(parts) + " (fixed, as the cluster workers run)"
    return _done
