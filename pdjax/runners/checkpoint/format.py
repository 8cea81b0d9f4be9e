"""The on-disk format of a checkpoint step: the metadata's fields (format versions 1 to
4) and their checks, and the CRC-32 checksums of the arrays and of the metadata.

Version 2 stores a parameter once per value (``same_as``), version 3 adds a checksum per
array (``checksum``), version 4 records its step (``step``) and a checksum of every other
field of the metadata (``checksums``), and marks its folder as pdjax's (:mod:`.folder`).
Every version stays readable; the metadata of versions 1 to 3 has no checksum.
"""

from __future__ import annotations

import functools
import json
import math
import re
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import jax
import numpy as np

from pdjax.errors import CheckpointError

# The format tag and layout version in every checkpoint's ``meta`` item.
FORMAT = "pdjax.checkpoint"
# 2: parameters stored once per value ("same_as"); 3: a checksum per array ("checksum");
# 4: the step ("step") and a checksum of each other metadata field ("checksums")
FORMAT_VERSION = 4
_READABLE_VERSIONS = (1, 2, 3, 4)
# The metadata fields of version 4 that earlier versions lack.
_V4_FIELDS = ("step", "checksums")
# The orbax item and file holding the metadata, inside a step's folder.
META_FILE = ("meta", "metadata")
# The orbax items of a step: every array, and the metadata.
ITEMS = ("arrays", "meta")


def shape_str(entry: Mapping[str, Any]) -> str:
    return f"{entry['dtype']}{list(entry['shape'])}"


class Damage(Exception):
    """A step whose files are damaged (what is wrong, without the way out): the public
    methods turn it into a :class:`CheckpointError` that also lists the steps that verify."""


def array_checksum(array: Any) -> str:
    """The checksum of an array's bytes in C order, its dtype and its shape. CRC-32: any
    flipped bit or burst of up to 32 changes it, and it runs at memory speed.

    A sharded ``jax.Array`` is not gathered: each of its distinct shards is fetched to host
    memory alone (:func:`distinct_blocks`), the CRC-32 of each run of it that is contiguous
    in the whole array's C order is taken, and the runs' CRCs are combined in that order
    (zlib's ``crc32_combine``). The result is the CRC-32 of the whole array's bytes, the
    same as one host copy gives: it does not depend on the sharding, so a step saved
    sharded verifies when read onto other shardings (another plan, another mesh), and the
    steps saved before shard-wise checksums verify as they did."""
    blocks = distinct_blocks(array)
    if blocks is None:
        data = np.ascontiguousarray(np.asarray(array))
        crc = zlib.crc32(f"{data.dtype.str}{list(data.shape)}".encode())
        # numpy declares ndarray a Buffer (__buffer__) only for Python >= 3.12
        crc = zlib.crc32(data.reshape(-1).view(np.uint8), crc)  # type: ignore[arg-type]
        return f"crc32:{crc:08x}"
    shape = tuple(int(n) for n in array.shape)
    runs: list[tuple[int, int, int]] = []  # (offset in the whole array, CRC-32, bytes)
    dtype = None
    for start, shard in blocks:
        host = np.ascontiguousarray(np.asarray(shard.data))  # this shard alone
        dtype = host.dtype
        runs += _runs(shape, start, host)
        del host
    assert dtype is not None  # a sharded array has shards
    crc = zlib.crc32(f"{dtype.str}{list(shape)}".encode())
    for _, part, size in sorted(runs):
        crc = _crc32_combine(crc, part, size)
    return f"crc32:{crc:08x}"


Block = tuple[tuple[int, ...], Any]  # (the shard's first index in the array, the shard)


def distinct_blocks(array: Any) -> list[Block] | None:
    """The distinct shards of a sharded ``jax.Array`` that this process holds whole (one
    replica of each block), as ``(first index, shard)`` in index order; None for anything
    else: a host array, a replicated or one-device array (one copy holds it all), an empty
    one, or one split across processes (the checkpoint gathers those first)."""
    if not isinstance(array, jax.Array) or not array.shape or array.size == 0:
        return None
    if array.is_fully_replicated or not array.is_fully_addressable:
        return None
    out = []
    for shard in array.addressable_shards:
        if shard.replica_id == 0:
            start = tuple(int(s.start or 0) for s in shard.index)
            out.append((start, shard))
    return sorted(out, key=lambda b: b[0])


def _runs(
    shape: tuple[int, ...], start: tuple[int, ...], host: np.ndarray
) -> list[tuple[int, int, int]]:
    """The runs of one block (``host``, at ``start`` in an array of ``shape``) that are
    contiguous in the whole array's C order, as (byte offset in the whole array, CRC-32,
    bytes): the block's rows over its last dimension that is split
    (every dimension after it is whole)."""
    split = [d for d in range(len(shape)) if host.shape[d] != shape[d]]
    last = split[-1] if split else 0
    inner = math.prod(shape[last + 1 :])
    outer = host.shape[:last]
    rows = host.reshape(math.prod(outer), -1).view(np.uint8)
    if last:
        index = np.indices(outer).reshape(last, -1) + np.array(start[:last])[:, None]
        first = np.ravel_multi_index(tuple(index), shape[:last])
    else:
        first = np.zeros(1, dtype=np.int64)
    offsets = (first.astype(np.int64) * shape[last] + start[last]) * inner * host.itemsize
    # numpy declares ndarray a Buffer (__buffer__) only for Python >= 3.12
    return [
        (int(o), zlib.crc32(row), row.nbytes)  # type: ignore[arg-type]
        for o, row in zip(offsets, rows, strict=True)
    ]


# CRC-32 (zlib's reflected polynomial) of the concatenation of two byte strings from their
# CRCs and the second's length, as zlib's crc32_combine (which Python's zlib lacks): the
# first CRC is multiplied by x^(8 * length) modulo the polynomial, then xored with the
# second. The multiplication by a fixed power is linear over GF(2), so it is kept, per
# length, as four tables of 256 entries (one per byte of the CRC).
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (bit-reflected, as zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # x^(2^k) modulo the polynomial


@functools.lru_cache(maxsize=64)
def _shift_tables(size: int) -> tuple[tuple[int, ...], ...]:
    """The multiplication by ``x^(8 * size)``, as four byte tables."""
    op, n, k = 1 << 31, size, 3
    while n:
        if n & 1:
            op = _multmodp(_X2N[k & 31], op)
        n >>= 1
        k += 1
    return tuple(tuple(_multmodp(op, v << (8 * i)) for v in range(256)) for i in range(4))


def _crc32_combine(crc1: int, crc2: int, size2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` (of ``A``), ``crc2`` (of ``B``) and ``size2``,
    the bytes of ``B``."""
    if size2 == 0:
        return crc1
    t = _shift_tables(size2)
    shifted = (
        t[0][crc1 & 0xFF] ^ t[1][(crc1 >> 8) & 0xFF] ^ t[2][(crc1 >> 16) & 0xFF] ^ t[3][crc1 >> 24]
    )
    return shifted ^ crc2


def _field_checksum(field: str, value: Any) -> str:
    """The checksum of one metadata field: CRC-32 of its name and value in canonical JSON
    (sorted keys, no spaces, ASCII), which a value read back from JSON encodes the same."""
    text = json.dumps([field, value], sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"crc32:{zlib.crc32(text.encode()):08x}"


def meta_checksums(meta: Mapping[str, Any]) -> dict[str, str]:
    """The checksum of every field of ``meta`` but ``checksums`` itself."""
    return {k: _field_checksum(k, v) for k, v in meta.items() if k != "checksums"}


def check_meta(
    meta: Any, file: Path, expect: tuple[str, tuple[str, ...]] | None, step: int | None = None
) -> None:
    """Raises :class:`_Damage` naming ``file`` and the field, for metadata that a restore
    could not use (a missing field, a wrong type, an unknown dtype or PRNG key), and, from
    version 4, for a field that changed after the save (its checksum) or metadata of
    another step than ``step`` (the folder's). ``expect``: the template's state type name
    and counters, which a step of that type must all hold (without a template, the
    counters it holds are checked)."""

    def bad(field: str, problem: str) -> NoReturn:
        raise Damage(f"its metadata {file} {problem} (field {field!r})")

    if not isinstance(meta, Mapping):
        bad("<top level>", f"is a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        bad("format", f"lacks pdjax's format tag {FORMAT!r}: pdjax did not write it")
    version = meta.get("version")
    if version not in _READABLE_VERSIONS:
        raise CheckpointError(
            f"{file} has checkpoint format version {version!r}; this pdjax reads versions "
            f"{', '.join(map(str, _READABLE_VERSIONS))}: restore it with the pdjax that "
            "wrote it (a newer one?)"
        )
    state = meta.get("state")
    if not (isinstance(state, str) and state.isidentifier()):
        bad("state", "names no state type (such as PipelineState or DPState)")
    ints = meta.get("ints")
    if not isinstance(ints, Mapping):
        bad("ints", "is missing or not an object")
    counters = list(ints)
    if expect is not None and expect[0] == state:
        counters += [name for name in expect[1] if name not in ints]
    for name in counters:
        value = ints.get(name)
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            bad(f"ints.{name}", "is missing or not an int (or a list of ints)")
    for field in ("arrays", "extra"):
        if not isinstance(meta.get(field), Mapping):
            bad(field, "is missing or not an object")
    layers = meta.get("stage_layers")
    if layers is not None and not (
        isinstance(layers, list) and all(isinstance(n, int) and n >= 0 for n in layers)
    ):
        bad("stage_layers", "is not a list of layer counts")
    for name, entry in meta["arrays"].items():
        problem = _entry_problem(entry, meta["arrays"], needs_checksum=version >= 3)
        if problem is not None:
            bad(f"arrays.{name}.{problem[0]}", problem[1])
    if version < 4:
        held = [f for f in _V4_FIELDS if f in meta]
        if held:
            bad("version", f"is {version}, yet it holds {held[0]!r}, which version 4 adds")
        return
    _check_sums(meta, bad)
    saved_step = meta["step"]
    if step is not None and saved_step != step:
        bad(
            "step",
            f"says step {saved_step}: it is another step's, in the folder of step {step} "
            "(step folders renamed or swapped)",
        )


def _check_sums(meta: Mapping[str, Any], bad: Callable[[str, str], NoReturn]) -> None:
    """Version 4: every field but ``checksums`` is there, as saved, and was saved."""
    sums = meta.get("checksums")
    if not (isinstance(sums, Mapping) and all(isinstance(v, str) for v in sums.values())):
        bad("checksums", "is missing or not an object of checksums")
    for field in sorted((set(meta) | set(sums)) - {"checksums"}):
        if field not in meta:
            bad(field, "is missing (the metadata was saved with it)")
        if field not in sums:
            bad(field, "was added after the save (it has no checksum)")
        if _field_checksum(field, meta[field]) != sums[field]:
            bad(field, "does not match its checksum (it changed after the save)")
    step = meta.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        bad("step", "is missing or not a step number")


def _entry_problem(
    entry: Any, arrays: Mapping[str, Any], *, needs_checksum: bool
) -> tuple[str, str] | None:
    """What is wrong with one array's manifest entry, as (its field, the problem)."""
    if not isinstance(entry, Mapping):
        return "", "is not an object"
    shape = entry.get("shape")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        return "shape", "is missing or not a list of sizes"
    try:
        dtype = np.dtype(entry.get("dtype"))
    except TypeError:
        return "dtype", f"is {entry.get('dtype')!r}, not a dtype"
    impl = entry.get("key_impl")
    if impl is not None:
        # jax leaves ShapeDtypeStruct.__init__ unannotated
        data = jax.ShapeDtypeStruct(tuple(shape), dtype)
        try:  # abstract: checks the name, and the key data's shape for it, allocating nothing
            jax.eval_shape(lambda d: jax.random.wrap_key_data(d, impl=str(impl)), data)
        except (TypeError, ValueError) as e:
            return "key_impl", f"is {impl!r}, not a PRNG key implementation for this data ({e})"
    first = entry.get("same_as")
    if first is not None:
        target = arrays.get(first) if isinstance(first, str) else None
        if not isinstance(target, Mapping) or "same_as" in target:
            return "same_as", f"names {first!r}, which is no stored array"
        if target.get("shape") != shape or target.get("dtype") != entry.get("dtype"):
            return "same_as", f"names {first!r}, of another shape or dtype"
    checksum = entry.get("checksum")
    if checksum is None and needs_checksum:
        return "checksum", "is missing"
    if checksum is not None and not re.fullmatch(r"crc32:[0-9a-f]{8}", str(checksum)):
        return "checksum", f"is {checksum!r}, not a crc32:<8 hex digits> checksum"
    return None
