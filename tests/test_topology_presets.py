"""The presets for one and three servers of SOSP'19 Cluster-A (Table 1's 1x4 and 3x4)."""

from __future__ import annotations

from pdjax.partition import Level, Topology


def test_one_server_of_cluster_a():
    topo = Topology.preset("1x4-v100-10gbps", memory_per_device=16e9)
    assert topo.num_devices == 4 and topo.num_levels == 1
    assert topo.levels[0] == Level(4, 1e10)  # Cluster-A's PCIe level
    assert topo.memory_per_device == 16e9


def test_three_servers_of_cluster_a():
    topo = Topology.preset("3x4-v100-10gbps")
    four = Topology.preset("4x4-v100-10gbps")
    assert topo.num_devices == 12
    assert topo.levels[0] == four.levels[0]  # the same servers
    assert topo.levels[1] == Level(3, four.levels[1].bandwidth)  # 10 Gbit/s, 3 of them
    assert topo.link_level(3, 4) == 1 and topo.link_level(8, 11) == 0
