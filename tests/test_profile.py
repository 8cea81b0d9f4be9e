"""The profiler: XLA counts against analytic ones, sizes, times, device models, JSON."""

import dataclasses
import io
import json
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from pdjax.errors import ProfileError
from pdjax.layers import sequential
from pdjax.partition import weight_grad_fraction
from pdjax.profile import DeviceModel, LayerProfile, Profile, get_device_model, profile

# counts XLA's compilations: no persistent cache (tests/xla_cache.py)
pytestmark = pytest.mark.no_xla_cache

_SPLIT = ("input_grad_flops", "weight_grad_flops", "input_grad_seconds", "weight_grad_seconds")


class _Tanh(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(x)


class _Block(nn.Module):
    """A residual MLP block: a stand-in for a transformer's repeated blocks."""

    width: int = 16

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(self.width)(jnp.tanh(nn.Dense(2 * self.width)(x)))


class _Scale(nn.Module):
    """A module with an array field: fields that do not compare make layers compile each."""

    w: Any

    @nn.compact
    def __call__(self, x):
        return x * self.w


class _Bf16Dense(nn.Module):
    """Mixed precision: float32 parameters, cast with the input to bfloat16 to compute."""

    features: int

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        return x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)


_PROFILED = {"apply", "vjp", "backward", "input_grad_only", "weight_grad_only", "init"}


@pytest.fixture
def compiles(monkeypatch):
    """Counts the profiler's ``Lowered.compile`` calls and XLA's compilations of its
    functions (the latter would also see a program recompiled behind its back)."""
    counts = {"lowered": 0, "xla": 0}
    original = jax.stages.Lowered.compile

    def counting(self, *args, **kwargs):
        counts["lowered"] += 1
        return original(self, *args, **kwargs)

    def listener(event, duration, **kwargs):
        del duration
        name = str(kwargs.get("fun_name", ""))
        if event == "/jax/core/compile/backend_compile_duration" and any(
            name == f"jit({f})" for f in _PROFILED
        ):
            counts["xla"] += 1

    monkeypatch.setattr(jax.stages.Lowered, "compile", counting)
    jax.monitoring.register_event_duration_secs_listener(listener)
    yield counts
    jax.monitoring.unregister_event_duration_listener(listener)


def test_each_program_compiles_once_and_identical_layers_share_theirs(compiles):
    # Dense(16) first (no input gradient: forward and backward), four blocks of one config
    # (forward, backward, its I and W halves: once), then Dense(4) (the same four)
    seq = sequential(nn.Dense(16), _Block(), _Block(), _Block(), _Block(width=16), nn.Dense(4))
    x = jnp.ones((8, 12))
    counted = profile(seq, x)
    assert compiles == {"lowered": 2 + 4 + 4, "xla": 2 + 4 + 4}
    names = [layer.name for layer in counted.layers]
    blocks = [dataclasses.replace(layer, name="") for layer in counted.layers[1:5]]
    assert all(block == blocks[0] for block in blocks), names
    # measured: the same programs, timed as compiled, plus per distinct layer the untimed
    # forward that makes the backward's inputs, and one initialisation of the model
    compiles.update(lowered=0, xla=0)
    measured = profile(seq, x, measure=True, warmup=0, repeats=1)
    assert compiles == {"lowered": 3 + 5 + 5 + 1, "xla": 3 + 5 + 5 + 1}
    for a, b in zip(counted.layers, measured.layers, strict=True):
        assert (a.forward_flops, a.backward_flops, a.input_grad_flops) == (
            b.forward_flops,
            b.backward_flops,
            b.input_grad_flops,
        )
        assert b.forward_seconds > 0 and b.backward_seconds > 0  # every layer timed
    assert measured.layers[3].input_grad_seconds > 0


def test_layers_that_differ_do_not_share_programs(compiles):
    # a different width, the same module on another input shape, array fields
    seq = sequential(
        nn.Dense(8), nn.Dense(8), nn.Dense(4), _Scale(jnp.ones((1, 4))), _Scale(jnp.ones((1, 4)))
    )
    prof = profile(seq, jnp.ones((2, 3)))
    # Dense(8) on 3 then on 8 features, Dense(4): 2 + 4 + 4; each _Scale: forward, backward
    assert compiles["lowered"] == 2 + 4 + 4 + 2 + 2
    assert prof.layers[0].forward_flops != prof.layers[1].forward_flops


def test_identical_nnx_layers_share_programs(compiles):
    seq = sequential(
        lambda rngs: nnx.Linear(6, 6, rngs=rngs),
        lambda rngs: nnx.Linear(6, 6, rngs=rngs),
        lambda rngs: nnx.Linear(6, 6, rngs=rngs),
        lambda rngs: nnx.Linear(6, 6, use_bias=False, rngs=rngs),
    )
    prof = profile(seq, jnp.ones((4, 6)))
    assert compiles["lowered"] == 2 + 4 + 4  # first; second = third; the bias-free one
    assert prof.layers[1].forward_flops == prof.layers[2].forward_flops
    assert prof.layers[3].forward_flops < prof.layers[2].forward_flops


def test_roofline_uses_the_dtype_a_layer_computes_in():
    # float32 parameters and input, cast to bfloat16 inside: costed at the bfloat16 peak
    chip = DeviceModel(
        name="test",
        peak_flops={"float32": 1e9, "bfloat16": 1e12},
        memory_bandwidth=1e18,  # compute-bound: seconds = FLOPs / peak
        memory_bytes=2**30,
    )
    seq = sequential(_Bf16Dense(32), nn.Dense(8))
    prof = profile(seq, jnp.ones((16, 64), jnp.float32), device_model=chip)
    mixed, dense = prof.layers
    assert prof.dtype == "float32"  # the parameters'
    assert mixed.output_shape == "bfloat16[16, 32]"
    assert mixed.forward_seconds == pytest.approx(mixed.forward_flops / 1e12)
    assert mixed.backward_seconds == pytest.approx(mixed.backward_flops / 1e12)
    # the float32 layer after it computes in float32 (its input is bfloat16, its output
    # float32: the output decides)
    assert dense.output_shape == "float32[16, 8]"
    assert dense.forward_seconds == pytest.approx(dense.forward_flops / 1e9)


def test_progress_reports_each_layer():
    seq = sequential(nn.Dense(4), _Tanh(), nn.Dense(2))
    calls = []
    prof = profile(seq, jnp.ones((2, 3)), progress=lambda *a: calls.append(a))
    names = [layer.name for layer in prof.layers]
    assert calls == [(0, 3, names[0]), (1, 3, names[1]), (2, 3, names[2]), (3, 3, None)]
    # a rich progress bar gets a task of its own, completed at the end
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(file=io.StringIO())) as bar:
        profile(seq, jnp.ones((2, 3)), progress=bar)
    (task,) = bar.tasks
    assert (task.completed, task.total, task.description) == (3, 3, "profiled")
    with pytest.raises(ProfileError, match="progress must be"):
        profile(seq, jnp.ones((2, 3)), progress=3)


def test_print_shows_a_table_and_repr_is_one_line():
    seq = sequential(nn.Dense(64), nn.Dense(8))
    prof = profile(seq, jnp.ones((32, 16)), device_model="h100")
    text = str(prof)
    lines = text.splitlines()
    assert lines[0] == "Profile: 2 layers, batch size 32, float32, times: model:h100"
    assert lines[1].split() == [
        "#",
        "layer",
        "fwd",
        "FLOPs",
        "bwd",
        "FLOPs",
        "params",
        "output",
        "fwd",
        "time",
        "bwd",
        "time",
    ]
    first = next(line for line in lines if prof.layers[0].name in line)
    # 2*32*16*64 + 32*64 = 67.58 K FLOPs; (16*64 + 64) * 4 B = 4.2 KiB; 32*64*4 B = 8 KiB
    assert "67.58 K" in first and "4.2 KiB" in first and "8.0 KiB" in first
    assert first.rstrip().endswith("ns")  # a roofline time of a tiny layer
    assert lines[-1].split()[0] == "total"
    assert len(lines) == 2 + 1 + 2 + 1 + 1  # title, header, rule, rows, rule, totals
    assert repr(prof) == (
        "Profile(2 layers, chain, batch_size=32, dtype='float32', time_source='model:h100')"
    )
    # without seconds no time columns; unknown counts print as "-"
    untimed = str(profile(seq, jnp.ones((32, 16))))
    assert "time" not in untimed.splitlines()[1]
    bare = Profile.chain([LayerProfile("a"), LayerProfile("b")], batch_size=1)
    assert str(bare).splitlines()[3].split() == ["0", "a", "-", "-", "0", "B", "0", "B"]


def test_dense_flops_equal_analytic_count():
    b, din, dout = 16, 32, 24
    prof = profile(sequential(nn.Dense(dout)), jnp.ones((b, din)))
    layer = prof.layers[0]
    assert layer.forward_flops == 2 * b * din * dout + b * dout  # matmul + bias
    assert layer.param_bytes == 4 * (din * dout + dout)
    assert layer.input_bytes == 4 * b * din and layer.output_bytes == 4 * b * dout
    assert layer.output_shape == "float32[16, 24]"


def test_conv_flops_equal_analytic_count():
    b, h, w, cin, cout, k = 4, 10, 9, 3, 8, 3
    prof = profile(sequential(nn.Conv(cout, (k, k), padding="VALID")), jnp.ones((b, h, w, cin)))
    ho, wo = h - k + 1, w - k + 1
    expected = 2 * b * ho * wo * cout * k * k * cin + b * ho * wo * cout
    assert prof.layers[0].forward_flops == expected


def test_backward_is_about_twice_forward_for_matmul_layers():
    # Past the first layer the backward computes both dW and dx: two matmuls per forward one.
    seq = sequential(nn.Dense(256), nn.Dense(256), nn.Dense(128))
    prof = profile(seq, jnp.ones((64, 128)))
    for layer in prof.layers[1:]:
        assert 1.9 < layer.backward_flops / layer.forward_flops < 2.1, layer
    # the first layer needs no input gradient: only dW
    first = prof.layers[0]
    assert 0.9 < first.backward_flops / first.forward_flops < 1.1


def test_measured_times_and_device_model_times():
    seq = sequential(nn.Dense(64), nn.Dense(8))
    x = jnp.ones((32, 16))
    measured = profile(seq, x, measure=True, repeats=3)
    assert measured.time_source.startswith("measured:cpu")
    assert all(
        layer.forward_seconds > 0 and layer.backward_seconds > 0 for layer in measured.layers
    )
    modelled = profile(seq, x, device_model="h100")
    h100 = get_device_model("h100")
    for layer in modelled.layers:
        expected = max(
            layer.forward_flops / h100.peak_flops["float32"],
            layer.forward_bytes_accessed / h100.memory_bandwidth,
        )
        assert layer.forward_seconds == pytest.approx(expected)
    assert modelled.time_source == "model:h100"
    half = profile(seq, x, device_model=get_device_model("h100", efficiency=0.5))
    assert half.layers[0].forward_seconds == pytest.approx(2 * modelled.layers[0].forward_seconds)


def test_dense_backward_splits_into_input_and_weight_gradients_of_equal_flops():
    # zero bubble's I (dx = ct W^T) and W (dW = x^T ct, db = sum ct): each one matmul
    b, din, dout = 16, 32, 24
    seq = sequential(nn.Dense(din), nn.Dense(dout, use_bias=False), nn.Dense(dout), _Tanh())
    prof = profile(seq, jnp.ones((b, din)))
    first, nobias, dense, tanh = prof.layers
    assert nobias.input_grad_flops == nobias.weight_grad_flops == 2 * b * din * dout
    assert dense.input_grad_flops == 2 * b * dout * dout
    assert dense.weight_grad_flops == 2 * b * dout * dout + (b - 1) * dout  # + bias sum
    for layer in (nobias, dense):  # one contraction each: I and W share no work
        assert layer.input_grad_flops + layer.weight_grad_flops == layer.backward_flops
    # the first layer needs no input gradient: its backward is all W; tanh's is all I
    assert (first.input_grad_flops, first.weight_grad_flops) == (0.0, first.backward_flops)
    assert (tanh.input_grad_flops, tanh.weight_grad_flops) == (tanh.backward_flops, 0.0)
    assert all(layer.input_grad_seconds is None for layer in prof.layers)
    frac = weight_grad_fraction(prof)
    assert frac[1] == 0.5 and frac[3] == 0.0 and frac[0] == 1.0
    mm, bias = 2 * b * dout * dout, (b - 1) * dout
    assert frac[2] == pytest.approx((mm + bias) / (2 * mm + bias))  # just over 1/2
    # with a device model the split's seconds come from the same roofline as B's
    h100 = get_device_model("h100")
    modelled = profile(seq, jnp.ones((b, din)), device_model=h100).layers[1]
    for flops, seconds in (
        (modelled.input_grad_flops, modelled.input_grad_seconds),
        (modelled.weight_grad_flops, modelled.weight_grad_seconds),
    ):
        assert h100.seconds(flops, 0.0) <= seconds <= modelled.backward_seconds


def test_measured_dense_split_is_near_half():
    # big enough that the matmuls, not the dispatch, take the time
    seq = sequential(nn.Dense(512, use_bias=False), nn.Dense(512, use_bias=False))
    prof = profile(seq, jnp.ones((256, 512)), measure=True, warmup=1, repeats=5)
    layer = prof.layers[1]
    assert layer.input_grad_seconds > 0 and layer.weight_grad_seconds > 0
    # two equal matmuls: about half each; measured times on a shared 2-core machine
    # drift (0.73 seen under load), so the bound only says both halves were measured
    assert 0.15 < weight_grad_fraction(prof)[1] < 0.85
    assert prof.layers[0].input_grad_seconds == 0.0
    assert prof.layers[0].weight_grad_seconds == prof.layers[0].backward_seconds
    # measured and counted profiles count the same programs
    counted = profile(seq, jax.ShapeDtypeStruct((256, 512), jnp.float32))
    for a, b in zip(prof.layers, counted.layers, strict=True):
        assert (a.input_grad_flops, a.weight_grad_flops) == (
            b.input_grad_flops,
            b.weight_grad_flops,
        )
        assert (a.forward_flops, a.backward_flops) == (b.forward_flops, b.backward_flops)


def test_pytree_activations_and_residuals():
    class Split(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x), jnp.tanh(x)

    class Join(nn.Module):
        @nn.compact
        def __call__(self, xs):
            a, b = xs
            return nn.Dense(2)(jnp.concatenate([a, b], axis=-1))

    prof = profile(sequential(nn.Dense(3), Split(), Join()), jnp.ones((8, 5)))
    split, join = prof.layers[1], prof.layers[2]
    assert split.output_bytes == 4 * 8 * (4 + 3)
    assert split.output_shape == "(float32[8, 4], float32[8, 3])"
    assert join.input_bytes == split.output_bytes
    # for dx, tanh's backward keeps one or two [8, 3] residuals (its output, 1 - y^2); the
    # Dense keeps only its input, which is counted in input_bytes, not residual_bytes
    assert 4 * 8 * 3 <= split.residual_bytes <= 2 * 4 * 8 * 3
    assert prof.layers[0].residual_bytes == 0  # first layer: no input gradient needed
    assert prof.is_chain and prof.edges == ((0, 1), (1, 2))


def test_abstract_sample_profiles_without_allocating():
    big = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    prof = profile(sequential(nn.Dense(4096), nn.Dense(4096)), big)
    assert prof.layers[0].param_bytes == 4 * (4096 * 4096 + 4096)
    assert prof.batch_size == 4096


def test_json_round_trip_is_exact(tmp_path):
    prof = profile(sequential(nn.Dense(7), nn.Dense(3)), jnp.ones((5, 4)), measure=True, repeats=1)
    again = Profile.from_json(prof.to_json())
    assert again == prof
    path = tmp_path / "p.json"
    prof.save(path)
    assert Profile.load(path) == prof
    assert json.loads(path.read_text())["format"] == "pdjax.profile/1"
    layer = again.layers[1]
    assert layer.input_grad_seconds > 0 and layer.weight_grad_flops > 0


def test_json_without_the_split_still_loads():
    # a profile written before the input/weight-gradient split (or by graph.txt) has none
    prof = profile(sequential(nn.Dense(7), nn.Dense(3)), jnp.ones((5, 4)))
    data = prof.to_dict()
    for raw in data["layers"]:
        for name in _SPLIT:
            del raw[name]
    old = Profile.from_json(json.dumps(data))
    assert all(getattr(layer, name) is None for layer in old.layers for name in _SPLIT)
    assert Profile.from_json(old.to_json()) == old
    assert old.layers[1].backward_flops == prof.layers[1].backward_flops


def test_replace_times_drops_the_split_seconds_keeps_its_flops():
    prof = profile(sequential(nn.Dense(7), nn.Dense(3)), jnp.ones((5, 4)), device_model="v100")
    new = prof.replace_times([1.0, 1.0], [2.0, 2.0], "manual")
    assert new.layers[1].input_grad_seconds is None and new.layers[1].weight_grad_seconds is None
    assert new.layers[1].input_grad_flops == prof.layers[1].input_grad_flops


def test_profile_is_deterministic_without_measurement():
    seq = sequential(nn.Conv(4, (3, 3)), nn.Dense(3))
    x = jnp.ones((2, 6, 6, 1))
    assert profile(seq, x).to_json() == profile(seq, x).to_json()


def test_bad_profile_input():
    seq = sequential(nn.Dense(2))
    with pytest.raises(ProfileError, match="leading batch dimension"):
        profile(seq, jnp.float32(1.0))
    with pytest.raises(ProfileError, match="not both"):
        profile(seq, jnp.ones((2, 2)), measure=True, device_model="h100")
    with pytest.raises(ProfileError, match="unknown device model 'k80'"):
        profile(seq, jnp.ones((2, 2)), device_model="k80")
    with pytest.raises(ProfileError, match="no forward_seconds"):
        profile(seq, jnp.ones((2, 2))).forward_seconds()
    with pytest.raises(ProfileError, match="at least one layer"):
        Profile.chain([], batch_size=1)
    with pytest.raises(ProfileError, match="topological"):
        Profile(layers=(LayerProfile("a"), LayerProfile("b")), edges=((1, 0),), batch_size=1)
    with pytest.raises(ProfileError, match="not a pdjax profile"):
        Profile.from_json('{"format": "other"}')


def test_cut_bytes_counts_each_crossing_output_once():
    layers = [
        dataclasses.replace(LayerProfile(str(i)), output_bytes=10 * (i + 1)) for i in range(4)
    ]
    # 0 -> 1 -> 2 -> 3 and a skip 0 -> 2 (a residual connection)
    prof = Profile(layers=tuple(layers), edges=((0, 1), (1, 2), (2, 3), (0, 2)), batch_size=1)
    assert list(prof.cut_bytes()) == [10, 10 + 20, 30, 0]
    assert not prof.is_chain


def test_malformed_profile_files_give_profile_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match=r"profile .*bad\.json is not valid JSON"):
        Profile.load(bad)
    bad.write_text('{"format": "pdjax.profile/1", "edges": []}')
    with pytest.raises(ProfileError, match="malformed pdjax profile: KeyError"):
        Profile.load(bad)
