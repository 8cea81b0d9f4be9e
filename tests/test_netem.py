"""The emulated cluster network: shaping, delay and teardown (skipped where it cannot run)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.harness.netem import (
    EmulatedNetwork,
    NetworkError,
    measure_round_trip,
    measure_throughput,
    network_support,
)

MB = 1_000_000


def _require(delay: bool = False) -> None:
    reason = network_support(delay=delay)
    if reason is not None:
        pytest.skip(reason)


def _namespaces() -> set[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    return {line.split()[0] for line in out.splitlines() if line}


def test_network_support_answers_in_one_line() -> None:
    reason = network_support()
    assert reason is None or (isinstance(reason, str) and reason and "\n" not in reason)


def test_command_names_and_addresses_without_setting_up() -> None:
    net = EmulatedNetwork(3, None, prefix="pdjunit", subnet="10.213.7.0/24")
    assert net.namespaces == ["pdjunith0", "pdjunith1", "pdjunith2"]
    assert net.switch == "pdjunitbr"
    assert net.addresses == ["10.213.7.1", "10.213.7.2", "10.213.7.3"]
    assert net.command(1, ["true"]) == ["ip", "netns", "exec", "pdjunith1", "true"]
    assert net.describe() == "3 hosts on veth through a bridge, unshaped, 0 ms delay"
    with pytest.raises(NetworkError, match="host 3"):
        net.command(3, ["true"])
    with pytest.raises(NetworkError, match="fewer than 5"):
        EmulatedNetwork(5, None, subnet="10.213.7.0/30")
    with pytest.raises(NetworkError, match="rate_mbit"):
        EmulatedNetwork(2, 0.0)


def test_default_prefixes_differ() -> None:
    a, b = EmulatedNetwork(2, None), EmulatedNetwork(2, None)
    assert a.prefix.startswith("pdj") and a.prefix != b.prefix
    assert not set(a.namespaces) & set(b.namespaces)


def test_rate_limit_holds() -> None:
    _require()
    with EmulatedNetwork(2, 100.0) as net:
        assert net.describe() == "2 hosts on veth through a bridge, 100 Mbit/s each way, 0 ms delay"
        # The best of three: a shared machine only ever makes a transfer slower.
        best = max(measure_throughput(net, 0, 1, 4 * MB) for _ in range(3))
        back = measure_throughput(net, 1, 0, 4 * MB)
    assert best == pytest.approx(12.5 * MB, rel=0.15)
    assert back < 12.5 * MB * 1.15


def test_unshaped_is_far_faster() -> None:
    _require()
    with EmulatedNetwork(2, None) as net:
        best = max(measure_throughput(net, 0, 1, 16 * MB) for _ in range(2))
    assert best > 4 * 12.5 * MB


def test_delay_shows_in_the_round_trip() -> None:
    _require(delay=True)
    with EmulatedNetwork(2, 100.0, delay_ms=20.0) as net:
        rtt = measure_round_trip(net, 0, 1, rounds=3)
    # 20 ms on each of the 2 links, each way: 80 ms there and back.
    assert rtt >= 4 * 0.020
    assert rtt < 4 * 0.020 + 0.5


def test_namespaces_are_gone_after_the_block() -> None:
    _require()
    with EmulatedNetwork(3, 100.0) as net:
        names = {*net.namespaces, net.switch}
        assert names <= _namespaces()
    assert not names & _namespaces()
    net.close()  # idempotent


def test_namespaces_are_gone_after_an_exception() -> None:
    _require()
    with pytest.raises(RuntimeError, match="boom"), EmulatedNetwork(2, None) as net:
        names = {*net.namespaces, net.switch}
        raise RuntimeError("boom")
    assert not names & _namespaces()


def test_failed_setup_cleans_up_only_its_own() -> None:
    _require()
    with EmulatedNetwork(2, None) as first:
        names = {*first.namespaces, first.switch}
        clash = EmulatedNetwork(2, None, prefix=first.prefix)
        with pytest.raises(NetworkError, match="netns add"), clash:
            pass
        assert names <= _namespaces()  # the clash deleted nothing it did not create
    assert not names & _namespaces()


def test_setup_failing_half_way_leaves_nothing() -> None:
    _require()
    prefix = f"pdjt{os.getpid() % 10000}"
    taken = f"{prefix}h1"  # host 1's namespace, after the switch's and host 0's
    subprocess.run(["ip", "netns", "add", taken], timeout=10, check=True)
    try:
        net = EmulatedNetwork(2, 100.0, prefix=prefix)
        with pytest.raises(NetworkError, match=f"netns add {taken}"), net:
            pass
        assert _namespaces() & {net.switch, *net.namespaces} == {taken}
    finally:
        subprocess.run(["ip", "netns", "delete", taken], timeout=10, check=True)


def test_atexit_deletes_namespaces_of_a_driver_that_never_left_the_block() -> None:
    _require()
    code = (
        "from benchmarks.harness.netem import EmulatedNetwork\n"
        "net = EmulatedNetwork(2, 100.0).__enter__()\n"
        "print(net.switch, *net.namespaces)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    names = set(out.split())
    assert len(names) == 3
    assert not names & _namespaces()
