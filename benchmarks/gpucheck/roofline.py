"""Part 2 of the GPU check: the device model's (roofline) layer times against measured ones."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from pdjax.partition import StagePlan
from pdjax.profile import Profile, get_device_model


def compare_profiles(
    measured: Profile, predicted: Profile, plan: Sequence[StagePlan]
) -> dict[str, Any]:
    """Per layer, per stage and in total: measured vs predicted forward + backward ms.

    Error is ``predicted / measured - 1`` (negative: the device model is too optimistic).
    Achieved TFLOP/s uses XLA's FLOP counts (forward + backward) over measured time.
    """

    def row(name: str, idx: Sequence[int]) -> dict[str, Any]:
        layers_m = [measured.layers[i] for i in idx]
        layers_p = [predicted.layers[i] for i in idx]
        fwd = sum(_secs(lp.forward_seconds) for lp in layers_m)
        bwd = sum(_secs(lp.backward_seconds) for lp in layers_m)
        pfwd = sum(_secs(lp.forward_seconds) for lp in layers_p)
        pbwd = sum(_secs(lp.backward_seconds) for lp in layers_p)
        flops = sum((lp.forward_flops or 0.0) + (lp.backward_flops or 0.0) for lp in layers_m)
        total, ptotal = fwd + bwd, pfwd + pbwd
        return {
            "name": name,
            "layers": [idx[0], idx[-1]],
            "measured_fwd_ms": fwd * 1e3,
            "measured_bwd_ms": bwd * 1e3,
            "measured_ms": total * 1e3,
            "predicted_fwd_ms": pfwd * 1e3,
            "predicted_bwd_ms": pbwd * 1e3,
            "predicted_ms": ptotal * 1e3,
            "error": ptotal / total - 1 if total > 0 else math.nan,
            "measured_tflops": flops / total / 1e12 if total > 0 else math.nan,
        }

    layers = [row(lp.name, [i]) for i, lp in enumerate(measured.layers)]
    stages = [
        row(f"stage {s}", list(range(st.first_layer, st.last_layer + 1)))
        for s, st in enumerate(plan)
    ]
    total = row("total", list(range(len(measured.layers))))
    return {
        "batch_size": measured.batch_size,
        "measured_source": measured.time_source,
        "predicted_source": predicted.time_source,
        "layers": layers,
        "stages": stages,
        "total": total,
        "median_abs_layer_error": statistics.median(abs(r["error"]) for r in layers),
    }


def _secs(value: float | None) -> float:
    return math.nan if value is None else float(value)


def roofline_check(
    measured: Profile,
    predicted: Profile,
    plan: Sequence[StagePlan],
    device_model: str,
    floor_ms_per_microbatch: float,
    dtype: str | None = None,
) -> dict[str, Any]:
    """:func:`compare_profiles`, with the device model's figures and the sum of the
    measured layers against the accumulation loop's milliseconds per microbatch (the same
    work timed whole, which says what timing layer by layer misses).

    ``dtype``: the compute dtype whose peak the report states (default: the profile's,
    its parameters' dtype, which a mixed precision policy keeps in float32).
    """
    comparison = compare_profiles(measured, predicted, plan)
    model = get_device_model(device_model)
    dtype = dtype or predicted.dtype
    comparison["device_model"] = {
        "name": model.name,
        "dtype": dtype,
        "peak_tflops": model.flops_per_second(dtype) / 1e12,
        "memory_tb_per_s": model.memory_bandwidth / 1e12,
        "efficiency": model.efficiency,
    }
    comparison["sum_of_layers_vs_floor"] = {
        "sum_of_layers_ms": comparison["total"]["measured_ms"],
        "floor_ms_per_microbatch": floor_ms_per_microbatch,
    }
    return comparison
