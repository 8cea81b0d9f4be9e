"""Device models: turn FLOP and byte counts into seconds for a device that is not present.

A :class:`DeviceModel` is a roofline: a layer takes
``max(flops / (peak_flops * efficiency), bytes / (memory_bandwidth * efficiency))``
seconds. With ``efficiency=1`` that is a lower bound (no device reaches its peak); the
planner only needs the *ratios* between layers to be right, which the roofline gets
right for layers that are clearly compute- or memory-bound.

Peak figures are the vendors' dense (no sparsity) numbers for the SXM / pod parts.
On TPUs XLA runs float32 matmuls at bfloat16 rate by default (``precision=DEFAULT``),
so their float32 peak is given as the bfloat16 one.
"""

from __future__ import annotations

import dataclasses

from pdjax.errors import ProfileError

__all__ = ["DEVICE_MODELS", "DeviceModel", "get_device_model"]


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """A roofline model of one accelerator.

    Attributes:
      name: preset name, e.g. ``"h100"``.
      peak_flops: peak FLOP/s by dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``).
      memory_bandwidth: device memory bandwidth, bytes/s.
      memory_bytes: device memory capacity, bytes.
      efficiency: fraction of the peaks assumed reachable (0 < efficiency <= 1).
    """

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: float
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1:
            raise ProfileError(f"efficiency must be in (0, 1], got {self.efficiency}")

    def flops_per_second(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (float32 if the dtype is not listed)."""
        return self.peak_flops.get(dtype, self.peak_flops["float32"])

    def seconds(self, flops: float, bytes_accessed: float, dtype: str = "float32") -> float:
        """Roofline time of a computation with the given FLOPs and bytes accessed."""
        compute = flops / (self.flops_per_second(dtype) * self.efficiency)
        memory = bytes_accessed / (self.memory_bandwidth * self.efficiency)
        return max(compute, memory)


def _model(name: str, fp32: float, bf16: float, bw: float, mem_gib: float) -> DeviceModel:
    return DeviceModel(
        name=name,
        peak_flops={"float32": fp32, "bfloat16": bf16, "float16": bf16},
        memory_bandwidth=bw,
        memory_bytes=mem_gib * 2**30,
    )


#: Presets by lower-case name.
DEVICE_MODELS: dict[str, DeviceModel] = {
    "v100": _model("v100", 15.7e12, 125e12, 900e9, 32),
    "a100": _model("a100", 19.5e12, 312e12, 2.039e12, 80),
    "h100": _model("h100", 67e12, 989e12, 3.35e12, 80),
    "h200": _model("h200", 67e12, 989e12, 4.8e12, 141),
    "tpu-v4": _model("tpu-v4", 275e12, 275e12, 1.2e12, 32),
    "tpu-v5e": _model("tpu-v5e", 197e12, 197e12, 819e9, 16),
}


def get_device_model(name: str, efficiency: float = 1.0) -> DeviceModel:
    """Looks up a preset (case-insensitive; ``tpuv4`` and ``tpu_v4`` work too).

    Raises:
      ProfileError: for an unknown name, listing the presets.
    """
    key = name.lower().replace("_", "-")
    if key.startswith("tpuv"):
        key = "tpu-" + key[3:]
    if key not in DEVICE_MODELS:
        raise ProfileError(
            f"unknown device model {name!r}; choose one of {sorted(DEVICE_MODELS)} "
            "(or 'measured' to time on the local device)"
        )
    return dataclasses.replace(DEVICE_MODELS[key], efficiency=efficiency)
