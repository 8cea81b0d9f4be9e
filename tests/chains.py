"""Profiles of made-up chains of layers, for the planner's tests."""

from pdjax.profile import LayerProfile, Profile


def chain_profile(times, params, outputs, batch_size=1) -> Profile:
    """Layer ``i`` takes ``times[i]`` seconds (a third forward, two thirds backward), holds
    ``params[i]`` parameter bytes and outputs ``outputs[i]`` bytes."""
    layers = [
        LayerProfile(
            f"l{i}",
            forward_seconds=t / 3,
            backward_seconds=2 * t / 3,
            param_bytes=p,
            output_bytes=o,
        )
        for i, (t, p, o) in enumerate(zip(times, params, outputs, strict=True))
    ]
    return Profile.chain(layers, batch_size=batch_size)
