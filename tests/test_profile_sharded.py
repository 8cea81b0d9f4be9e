"""Costs of a sharded layer read from XLA (``pdjax.profile.sharded``): per-device FLOPs,
the collectives XLA's partitioner inserted and the mesh axes they run over, identical
layers compiled once, and nothing allocated."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from pdjax.errors import ProfileError
from pdjax.layers import sequential
from pdjax.models import get_model
from pdjax.profile.sharded import Collective, collectives_of, profile_sharded

ROWS, WIDTH, HIDDEN = 16, 64, 256


class _Block(nn.Module):
    """A Megatron-style MLP block: the first kernel split by columns, the second by rows."""

    @nn.compact
    def __call__(self, x):
        up = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        down = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        h = nn.relu(nn.Dense(HIDDEN, kernel_init=up, use_bias=False)(x))
        return x + nn.Dense(WIDTH, kernel_init=down, use_bias=False)(h)


MESHES = [{"data": 1}, {"tensor": 2}, {"fsdp": 2}, {"fsdp": 2, "tensor": 2}]
KERNEL = WIDTH * HIDDEN * 4  # bytes of one whole kernel


@pytest.fixture(scope="module")
def block_costs():
    # shapes only: nothing of the model is allocated
    sample = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32)
    return profile_sharded(sequential(_Block(), _Block()), sample, MESHES)


def test_tensor_parallelism_halves_the_flops_and_all_reduces_the_activation(block_costs):
    whole, tensor = block_costs[0][0], block_costs[0][1]
    assert whole.forward_collectives == () and whole.backward_collectives == ()
    assert tensor.forward_flops == pytest.approx(whole.forward_flops / 2, rel=0.05)
    assert tensor.backward_flops == pytest.approx(whole.backward_flops / 2, rel=0.05)
    # the row-split kernel's partial sums: one all-reduce of the output, over tensor
    activation = ROWS * WIDTH * 4
    assert tensor.forward_collectives == (Collective("all-reduce", activation, ("tensor",)),)
    assert tensor.param_bytes == KERNEL  # two kernels, each half on this device
    assert tensor.replicated_param_bytes == 0


def test_fsdp_gathers_the_weights_and_reduces_their_gradients_over_fsdp(block_costs):
    whole, fsdp = block_costs[0][0], block_costs[0][2]
    assert fsdp.forward_flops == pytest.approx(whole.forward_flops / 2, rel=0.05)
    gathered = [c for c in fsdp.forward_collectives if c.kind == "all-gather"]
    assert sum(c.nbytes for c in gathered) == 2 * KERNEL  # each kernel whole, once
    assert all(c.axes == ("fsdp",) for c in fsdp.forward_collectives)
    reduced = [c for c in fsdp.backward_collectives if c.kind in ("all-reduce", "reduce-scatter")]
    assert reduced and all(c.axes == ("fsdp",) for c in reduced)


def test_on_a_two_by_two_mesh_each_collective_names_its_axes(block_costs):
    both = block_costs[0][3]
    assert both.param_bytes == 2 * KERNEL // 4
    kinds = {(c.kind, c.axes) for c in both.forward_collectives}
    # the weights gathered over fsdp, the partial sums reduced over tensor, on the half
    # of the microbatch's rows this device's fsdp coordinate holds
    assert ("all-gather", ("fsdp",)) in kinds
    assert ("all-reduce", ("tensor",)) in kinds
    reduce = next(c for c in both.forward_collectives if c.kind == "all-reduce")
    assert reduce.nbytes == ROWS // 2 * WIDTH * 4
    assert both.collective_bytes("tensor") < both.collective_bytes("fsdp")


def test_identical_layers_share_one_compile(block_costs):
    for k in range(len(MESHES)):
        first, second = block_costs[0][k], block_costs[1][k]
        assert first.shared_with is None and second.shared_with == 0
        assert second.forward_collectives == first.forward_collectives
        assert second.forward_flops == first.forward_flops


def test_llama_blocks_share_and_every_parameter_is_split():
    spec = get_model("llama", "tiny")
    sample = spec.sample_input(4, jax.random.key(0))
    costs = profile_sharded(spec.layers, sample, [{"fsdp": 2, "tensor": 2}])
    names = [row[0].name for row in costs]
    assert names == ["embed", "block0", "block1", "head"]
    assert costs[2][0].shared_with == 1  # block1 reuses block0's programs
    block = costs[1][0]
    # the RMSNorm scales stay whole; every other parameter is split 4 ways
    whole = sum(
        np.prod(a.shape) * 4
        for a in jax.tree.leaves(
            jax.eval_shape(spec.layers.layers[1].init, jax.random.key(0), sample)["params"]
        )
    )
    assert block.replicated_param_bytes == 2 * 32 * 4
    assert block.param_bytes - block.replicated_param_bytes == (whole - 2 * 32 * 4) // 4
    assert block.forward_collectives and block.backward_collectives


def test_a_mesh_larger_than_the_devices_is_refused_before_compiling():
    with pytest.raises(ProfileError, match="spans 16 devices and only 8 are given"):
        profile_sharded(sequential(_Block()), jnp.ones((ROWS, WIDTH)), [{"tensor": 16}])


def test_collectives_are_read_from_hlo_text_with_their_axes():
    devices = np.asarray(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("fsdp", "tensor"))
    hlo = "\n".join(
        [
            # partitions {0,1} and {2,3} differ along tensor (the last axis)
            "  %a = f32[8,64]{1,0} all-reduce(f32[8,64]{1,0} %x), channel_id=1, "
            "replica_groups={{0,1},{2,3}}, use_global_device_ids=true, to_apply=%add",
            # the iota form of {{0,2},{1,3}}: along fsdp
            "  %b = bf16[4,32]{1,0} all-gather(bf16[2,32]{1,0} %y), channel_id=2, "
            "replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}, use_global_device_ids=true",
            # an asynchronous start: the larger of (operand, result)
            "  %c = (f32[2]{0}, f32[8]{0}) all-gather-start(f32[2]{0} %z), channel_id=3, "
            "replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true",
            "  %d = f32[8]{0} all-gather-done((f32[2]{0}, f32[8]{0}) %c)",
        ]
    )
    assert collectives_of(hlo, mesh) == (
        Collective("all-reduce", 8 * 64 * 4, ("tensor",)),
        Collective("all-gather", 4 * 32 * 2, ("fsdp",)),
        Collective("all-gather", 8 * 4, ("fsdp", "tensor")),
    )


def test_each_collective_is_priced_on_the_level_its_axes_span():
    from pdjax.partition.pricing.sharded import collective_seconds, sharded_seconds
    from pdjax.plan import Topology
    from pdjax.profile import get_device_model

    # 2 servers of 2 devices: 100 GB/s inside a server, 1 GB/s between them
    topology = Topology.from_levels([2, 2], [1e11, 1e9])
    mesh = (("fsdp", 2), ("tensor", 2))  # tensor over neighbours: inside a server
    positions = [0, 1, 2, 3]
    reduce_t = Collective("all-reduce", 1000, ("tensor",))
    gather_f = Collective("all-gather", 1000, ("fsdp",))
    assert collective_seconds(reduce_t, mesh, positions, topology) == pytest.approx(1000 / 1e11)
    assert collective_seconds(gather_f, mesh, positions, topology) == pytest.approx(500 / 1e9)
    both = Collective("reduce-scatter", 250, ("fsdp", "tensor"))
    assert collective_seconds(both, mesh, positions, topology) == pytest.approx(3 * 250 / 1e9)
    # the same mesh with fsdp inside the server and tensor across: the costs swap levels
    across = [0, 2, 1, 3]
    assert collective_seconds(reduce_t, mesh, across, topology) == pytest.approx(1000 / 1e9)
    assert collective_seconds(gather_f, mesh, across, topology) == pytest.approx(500 / 1e11)

    h100 = get_device_model("h100")
    sample = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32)
    (cost,) = profile_sharded(sequential(_Block()), sample, [{"tensor": 2}])[0]
    seconds = sharded_seconds(cost, h100, Topology.from_levels([2], [1e11]), [0, 1])
    assert seconds.forward == pytest.approx(h100.seconds(cost.forward_flops, cost.forward_bytes))
    assert seconds.forward_collectives == pytest.approx(ROWS * WIDTH * 4 / 1e11)
    assert seconds.total > seconds.forward + seconds.backward
