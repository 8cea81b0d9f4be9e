"""Profiling: per-layer costs from XLA's cost analysis, measurement, or PipeDream's graph.txt."""

from pdjax.profile.graph_txt import parse_graph_txt, read_graph_txt
from pdjax.profile.profile import LayerProfile, Profile

__all__ = ["LayerProfile", "Profile", "parse_graph_txt", "read_graph_txt"]
