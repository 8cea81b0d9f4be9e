"""What the GPU check measures: its two sizes (full and tiny), the two model families
(GPT, Llama) and precisions they build, and the runner names every ratio refers to."""

from __future__ import annotations

import dataclasses

from pdjax.apps.train.model_data import with_precision
from pdjax.models import ModelSpec, get_model
from pdjax.models.gpt import GPTConfig, make_spec

#: The runner every ratio is taken against.
BASELINE = "one jit per batch"
#: The runners whose overhead the check is about.
PIPELINES = ("1f1b", "pipedream")
#: Machinery overhead goal: a pipeline takes at most this much longer per sample.
OVERHEAD_GOAL = 0.05
#: Model families the check builds (``--model``): the ~350M sizes are
#: :meth:`GPTConfig.medium` and :meth:`pdjax.models.LlamaConfig.paper`.
MODELS = ("gpt", "llama")
#: ``--precision``: float32 throughout, or pdjax's mixed policy (float32 parameters and
#: layer outputs, bfloat16 compute: :func:`pdjax.precision.get_policy`).
PRECISIONS = ("float32", "bf16")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What differs between the full and the tiny run (nothing else does).

    Attributes:
      model: ``"350m"`` (:meth:`GPTConfig.medium`, or Llama's ``paper``) or ``"tiny"``
        (the family's tiny config).
      batch: samples per optimizer step (all runners).
      microbatches: ``M``, microbatches per step; ``batch`` must be divisible by it.
      steps: optimizer steps per timed round (pipedream: one stream of ``steps * M``).
      rounds: timed rounds after the two warm-up rounds.
      stages: pipeline stages, all on one device.
      profile_repeats: timed runs per layer in the measured profile (median kept).
    """

    model: str
    batch: int
    microbatches: int
    steps: int
    rounds: int
    stages: int
    profile_repeats: int

    @property
    def microbatch(self) -> int:
        return self.batch // self.microbatches


#: Batch 16: XLA's buffer assignment for one jitted step of the 350m GPT over 16 samples
#: of 512 tokens needs ~43 GB of temporaries (the attention scores are materialised), 32
#: samples ~85 GB: too much next to five runners' weights and Adam states (~4.4 GB each).
#: The same batch for Llama ``paper`` (336M params, 512 tokens, vocabulary 32000, untied
#: head): each runner holds 4.0 GB (weights 1.34 GB + Adam's two moments 2.69 GB), five
#: of them ~20 GB plus PipeDream's stashed weight versions (< 1.4 GB); one jitted step's
#: temporaries, by XLA:CPU's buffer assignment (``compiled.memory_analysis()``, measured
#: 2026-12-03), are 44 GB over 16 samples in float32 (32 GB under ``bf16``: activations
#: in bfloat16, parameters and layer outputs float32) and 88 GB over 32 (62 GB bf16).
#: 16: ~20 + 44 = ~64 GB of the ~125 GB pool (90% of 139 GiB); 32 in float32 would be
#: ~108 GB, too close to the pool for a check that must not fail on memory.
FULL = Sizes("350m", batch=16, microbatches=4, steps=4, rounds=5, stages=4, profile_repeats=5)
TINY = Sizes("tiny", batch=8, microbatches=4, steps=1, rounds=2, stages=4, profile_repeats=2)


def build_spec(model: str, family: str = "gpt", precision: str = "float32") -> ModelSpec:
    """The model to measure, without dropout in every size and family.

    Without dropout every runner computes the same loss on the same weights and batch (a
    check that they do the same work); with it, each would draw its own masks. Under
    ``precision="bf16"`` every layer computes under pdjax's mixed policy
    (:func:`pdjax.apps.train.model_data.with_precision`); all runners take the spec's
    layers, so the one-jit baseline runs the same policy as the pipelines.

    Args:
      model: ``"350m"`` or ``"tiny"``.
      family: ``"gpt"`` (350m: :meth:`GPTConfig.medium`) or ``"llama"`` (350m:
        ``LlamaConfig.paper``, 336M parameters).
      precision: one of :data:`PRECISIONS`.
    """
    if family not in MODELS:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(MODELS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if model == "tiny":
        spec = get_model(family, "tiny", dropout=0.0)
    elif model == "350m":
        spec = (
            make_spec(GPTConfig.medium(), "350m")
            if family == "gpt"
            else get_model("llama", "paper", dropout=0.0)
        )
    else:
        raise ValueError(f"unknown model size {model!r}; choose 350m or tiny")
    return with_precision(spec, precision)
