"""What the GPU check measures: its two sizes (full and tiny), the GPT they build and the
runner names every ratio refers to."""

from __future__ import annotations

import dataclasses

from pdjax.models import ModelSpec, get_model
from pdjax.models.gpt import GPTConfig, make_spec

#: The runner every ratio is taken against.
BASELINE = "one jit per batch"
#: The runners whose overhead the check is about.
PIPELINES = ("1f1b", "pipedream")
#: Machinery overhead goal: a pipeline takes at most this much longer per sample.
OVERHEAD_GOAL = 0.05


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What differs between the full and the tiny run (nothing else does).

    Attributes:
      model: ``"350m"`` (:meth:`GPTConfig.medium`) or ``"tiny"`` (pdjax's tiny GPT).
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
FULL = Sizes("350m", batch=16, microbatches=4, steps=4, rounds=5, stages=4, profile_repeats=5)
TINY = Sizes("tiny", batch=8, microbatches=4, steps=1, rounds=2, stages=4, profile_repeats=2)


def build_spec(model: str) -> ModelSpec:
    """The GPT to measure, without dropout in both sizes.

    Without dropout every runner computes the same loss on the same weights and batch (a
    check that they do the same work); with it, each would draw its own masks.
    """
    if model == "tiny":
        return get_model("gpt", "tiny", dropout=0.0)
    if model == "350m":
        return make_spec(GPTConfig.medium(), "350m")
    raise ValueError(f"unknown model size {model!r}; choose 350m or tiny")
