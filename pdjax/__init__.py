"""pdjax: PipeDream-style pipeline-parallel training on JAX/XLA and Flax.

Profile a model (a sequence of Flax modules), plan stages and replication over devices,
pick a schedule, and train:

>>> import jax, jax.numpy as jnp, flax.linen as nn, optax
>>> import pdjax
>>> layers = pdjax.sequential(nn.Dense(16), nn.Dense(16), nn.Dense(4))
>>> prof = pdjax.profile(layers, jnp.ones((8, 8)))
>>> prof.layers[0].forward_flops == 2 * 8 * 8 * 16 + 8 * 16  # matmul + bias, per XLA
True
>>> pipe = pdjax.Pipeline(layers, pdjax.even_stages(3, 3), lambda y, t: ((y - t) ** 2).mean(),
...                       optax.sgd(0.1), schedule=pdjax.ScheduleSpec("1f1b", microbatches=2))
>>> state = pipe.init(jax.random.key(0), jnp.ones((4, 8)))
>>> state, metrics = pipe.step(state, (jnp.ones((8, 8)), jnp.zeros((8, 4))))
>>> state.updates
(1, 1, 1)
"""

from pdjax.errors import (
    CheckpointError,
    DataError,
    GraphFormatError,
    LayerError,
    PdjaxError,
    PipelineError,
    PlanError,
    ProfileError,
    ScheduleError,
)
from pdjax.export import linen_variables, update_nnx
from pdjax.layers import Fn, LayerSequence, sequential, split_model
from pdjax.layers.sharding import ShardingRules
from pdjax.partition import Plan, Topology, plan_pipedream
from pdjax.pipeline import Pipeline, PipelineState, even_stages
from pdjax.profile import Profile, profile
from pdjax.runners import Checkpointer, DataParallel, Runner, RunnerState
from pdjax.schedules import Schedule, ScheduleSpec, generate, validate
from pdjax.simulator import simulate

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "DataError",
    "DataParallel",
    "Fn",
    "GraphFormatError",
    "LayerError",
    "LayerSequence",
    "PdjaxError",
    "Pipeline",
    "PipelineError",
    "PipelineState",
    "Plan",
    "PlanError",
    "Profile",
    "ProfileError",
    "Runner",
    "RunnerState",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "ShardingRules",
    "Topology",
    "even_stages",
    "generate",
    "linen_variables",
    "plan_pipedream",
    "profile",
    "sequential",
    "simulate",
    "split_model",
    "update_nnx",
    "validate",
]
