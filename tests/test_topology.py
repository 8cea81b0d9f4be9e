"""Topology: levels, presets, local devices, JSON, and bad numbers."""

from __future__ import annotations

import math

import jax
import pytest

from pdjax.errors import PlanError
from pdjax.partition import PRESETS, Level, Topology, parse_levels


def test_levels_innermost_first():
    topo = Topology.from_levels([4, 4], [1e10, 1.25e9])
    assert topo.num_devices == 16 and topo.num_levels == 2
    assert [lvl.workers for lvl in topo.levels] == [4, 4]
    assert topo.group_size(0) == 1 and topo.group_size(1) == 4 and topo.group_size(2) == 16
    assert topo.link_level(0, 3) == 0  # same server
    assert topo.link_level(3, 4) == 1  # across servers
    assert topo.link_level(5, 5) == 0
    assert Topology([(4, 1e10), (4, 1.25e9)]) == topo
    assert topo.device_id(7) == 7


def test_flat_and_describe():
    topo = Topology.flat(8, 1.25e9, memory_per_device=16e9)
    assert topo.num_devices == 8 and topo.memory_per_device == 16e9
    assert "8 devices" in topo.describe() and "1.25e+09" in topo.describe()
    assert topo.with_memory(None).memory_per_device is None


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets(name):
    topo = Topology.preset(name)
    workers, bandwidths, description = PRESETS[name]
    assert tuple(lvl.workers for lvl in topo.levels) == workers
    assert tuple(lvl.bandwidth for lvl in topo.levels) == bandwidths
    assert topo.memory_per_device is None and description


def test_cluster_a_is_four_servers_of_four_at_10_gbps():
    topo = Topology.preset("cluster-a", memory_per_device=16e9)
    assert topo.num_devices == 16
    assert topo.levels[1] == Level(4, 1.25e9)
    assert topo.memory_per_device == 16e9


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(PlanError, match="cluster-a"):
        Topology.preset("cluster-z")


def test_from_local_devices():
    topo = Topology.from_devices()
    devices = jax.devices()
    assert topo.num_devices == len(devices)
    assert topo.device_ids == tuple(d.id for d in devices)
    assert topo.levels[0].bandwidth == 1e10
    assert topo.memory_per_device is None  # CPU devices report no limit
    two = Topology.from_devices(devices[:2], bandwidth=5e9, memory_per_device=1e9)
    assert two.num_devices == 2 and two.levels[0].bandwidth == 5e9
    assert two.memory_per_device == 1e9


def test_json_round_trip():
    for topo in (
        Topology.from_levels([4, 4], [1e10, 1.25e9], memory_per_device=1.5e10, name="x"),
        Topology.from_devices(),
    ):
        assert Topology.from_json(topo.to_json()) == topo


def test_parse_levels():
    assert parse_levels("4x4") == (4, 4)
    assert parse_levels("8X2") == (8, 2)
    assert parse_levels("16") == (16,)
    for bad in ("", "4x", "4xq", "0x4", "-1"):
        with pytest.raises(PlanError, match="innermost first"):
            parse_levels(bad)


@pytest.mark.parametrize("bandwidth", [0, -1e9, math.nan, math.inf, "fast", True])
def test_bad_bandwidth(bandwidth):
    with pytest.raises(PlanError, match="bandwidth"):
        Topology.from_levels([4], [bandwidth])


@pytest.mark.parametrize("workers", [0, -2, 2.5, True])
def test_bad_workers(workers):
    with pytest.raises(PlanError, match="workers"):
        Topology.from_levels([workers], [1e9])


def test_other_bad_input():
    with pytest.raises(PlanError, match="2 levels of workers but 1 bandwidths"):
        Topology.from_levels([4, 4], [1e9])
    with pytest.raises(PlanError, match="at least one level"):
        Topology(())
    with pytest.raises(PlanError, match="memory_per_device"):
        Topology.flat(4, 1e9, memory_per_device=0)
    with pytest.raises(PlanError, match="3 device_ids"):
        Topology((Level(4, 1e9),), device_ids=(0, 1, 2))
    with pytest.raises(PlanError, match="not a pdjax topology"):
        Topology.from_dict({"format": "x"})


def test_latency_per_level_round_trips_and_defaults_to_zero():
    topo = Topology.from_levels([4, 2], [1e10, 1.25e9], latencies=[5e-6, 1e-4])
    assert [lvl.latency for lvl in topo.levels] == [5e-6, 1e-4]
    assert "latency 5e-06, 0.0001 s" in topo.describe()
    assert Topology.from_json(topo.to_json()) == topo
    # JSON written before the field existed reads as 0.
    data = topo.to_dict()
    for lvl in data["levels"]:
        del lvl["latency"]
    old = Topology.from_dict(data)
    assert [lvl.latency for lvl in old.levels] == [0.0, 0.0]
    assert Topology.from_levels([4], [1e9]).levels[0].latency == 0.0
    assert "latency" not in Topology.flat(4, 1e9).describe()


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, "1", True])
def test_bad_latency(bad):
    with pytest.raises(PlanError, match="latency must be a finite number"):
        Topology([Level(4, 1e9, "", bad)])


def test_latencies_need_one_per_level():
    with pytest.raises(PlanError, match="1 latencies"):
        Topology.from_levels([4, 4], [1e10, 1e9], latencies=[0.0])
