"""Partitioning: topologies, cost models, PipeDream's optimizer and simpler partitioners.

>>> from pdjax.partition import Topology, plan_pipedream
>>> topo = Topology.from_levels([4, 4], [1e10, 1.25e9])  # 4 servers of 4 devices
>>> topo.num_devices
16
"""

from pdjax.partition.choosing.auto import HostCosts, auto_choice, plan_auto
from pdjax.partition.choosing.buckets import (
    bucket_weights,
    mix_profiles,
    mix_time_per_microbatch,
    plan_buckets,
    profile_buckets,
    simulate_buckets,
)
from pdjax.partition.choosing.simulator_costs import costs_from_plan, weight_grad_fraction
from pdjax.partition.pricing.cost import COST_MODELS, CostModel
from pdjax.partition.pricing.traits import REPLICATION_OPTIONS, SCHEDULE_TRAITS, ScheduleTraits
from pdjax.partition.search.partitioners import (
    balanced_split,
    evaluate_partition,
    plan_balanced_params,
    plan_balanced_time,
    plan_uniform,
    uniform_split,
)
from pdjax.partition.search.pipedream import plan_pipedream
from pdjax.plan.plan import Plan, StagePlan
from pdjax.plan.topology import PRESETS, Level, Topology, parse_levels

__all__ = [
    "COST_MODELS",
    "PRESETS",
    "REPLICATION_OPTIONS",
    "SCHEDULE_TRAITS",
    "CostModel",
    "HostCosts",
    "Level",
    "Plan",
    "ScheduleTraits",
    "StagePlan",
    "Topology",
    "auto_choice",
    "balanced_split",
    "bucket_weights",
    "costs_from_plan",
    "evaluate_partition",
    "mix_profiles",
    "mix_time_per_microbatch",
    "parse_levels",
    "plan_auto",
    "plan_balanced_params",
    "plan_balanced_time",
    "plan_buckets",
    "plan_pipedream",
    "plan_uniform",
    "profile_buckets",
    "simulate_buckets",
    "uniform_split",
    "weight_grad_fraction",
]
