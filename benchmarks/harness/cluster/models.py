"""The cluster benchmark's models and their microbatches and link rates."""

from __future__ import annotations

from typing import Any

from pdjax.errors import ClusterError

#: Samples per microbatch of each benchmark model.
MICROBATCH = {"mlp-512": 128, "vgg-fc": 32}
#: Link rates (Mbit/s each way) each model runs at: every 2-stage cut, DP and one worker.
RATES: dict[str, tuple[float, ...]] = {"mlp-512": (1000.0, 10000.0), "vgg-fc": (100.0, 1000.0)}

#: The benchmark's models: ``name -> (family, overrides)`` for :func:`pdjax.models.get_model`.
CLUSTER_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp-512": ("mlp", {"in_features": 512, "hidden": (512,) * 8}),
    # next to no compute: what a microbatch costs the machinery itself (tests, diagnosis)
    "mlp-narrow": ("mlp", {"in_features": 16, "hidden": (16,) * 8}),
    "vgg-fc": (
        "vgg16",
        {
            "image_size": 32,
            "stages": ((16,), (32,), (64, 64), (64, 64), (64, 64)),
            "hidden": 2048,
        },
    ),
    # time to accuracy on real data (benchmarks.harness.cluster_tta): vgg-fc's shape for 8x8 digits
    # (2 convolution blocks, then 2048-wide fully connected layers: 19 MB of weights), and
    # the tiny GPT on characters of Python's docs (0.4 MB of weights)
    "vgg-digits": (
        "vgg16",
        {"image_size": 8, "in_channels": 1, "stages": ((32,), (64, 64)), "hidden": 2048},
    ),
    "gpt-text": ("gpt", {}),
    # a small one for the tests of time to accuracy (flattened digits)
    "mlp-digits": ("mlp", {"in_features": 64, "hidden": (64, 64)}),
}


def cluster_model(name: str) -> Any:
    """The :class:`~pdjax.models.ModelSpec` of a benchmark model (tiny config + overrides)."""
    from pdjax.models import get_model

    if name not in CLUSTER_MODELS:
        raise ClusterError(f"unknown cluster model {name!r}; choose one of {list(CLUSTER_MODELS)}")
    family, overrides = CLUSTER_MODELS[name]
    return get_model(family, "tiny", **overrides)
