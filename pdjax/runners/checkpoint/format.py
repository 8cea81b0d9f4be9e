"""The on-disk format of a checkpoint step: the metadata's fields (format versions 1 to
4) and their checks, and the CRC-32 checksums of the arrays and of the metadata.

Version 2 stores a parameter once per value (``same_as``), version 3 adds a checksum per
array (``checksum``), version 4 records its step (``step``) and a checksum of every other
field of the metadata (``checksums``), and marks its folder as pdjax's (:mod:`.folder`).
Every version stays readable; the metadata of versions 1 to 3 has no checksum.
"""

from __future__ import annotations

import json
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
    """The checksum of an array's host bytes (C order), its dtype and its shape. CRC-32:
    any flipped bit or burst of up to 32 changes it, and it runs at memory speed."""
    data = np.ascontiguousarray(np.asarray(array))
    crc = zlib.crc32(f"{data.dtype.str}{list(data.shape)}".encode())
    # numpy declares ndarray a Buffer (__buffer__) only for Python >= 3.12
    crc = zlib.crc32(data.reshape(-1).view(np.uint8), crc)  # type: ignore[arg-type]
    return f"crc32:{crc:08x}"


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
