"""Profiling: per-layer costs from XLA's cost analysis, measurement, or PipeDream's graph.txt."""

from pdjax.profile.devices import DEVICE_MODELS, DeviceModel, get_device_model
from pdjax.profile.graph_txt import (
    PUBLISHED_PROFILES,
    parse_graph_txt,
    published_profile,
    read_graph_txt,
)
from pdjax.profile.profile import LayerProfile, PolicyCost, Profile
from pdjax.profile.sharded import Collective, ShardedCost, profile_sharded
from pdjax.profile.xla import cost_analysis, profile

__all__ = [
    "DEVICE_MODELS",
    "PUBLISHED_PROFILES",
    "Collective",
    "DeviceModel",
    "LayerProfile",
    "PolicyCost",
    "Profile",
    "ShardedCost",
    "cost_analysis",
    "get_device_model",
    "parse_graph_txt",
    "profile",
    "profile_sharded",
    "published_profile",
    "read_graph_txt",
]
