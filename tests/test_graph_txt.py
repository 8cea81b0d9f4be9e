"""PipeDream's graph.txt profiles: parsing, DAGs, totals, malformed files."""

from pathlib import Path

import pytest

from pdjax.errors import GraphFormatError
from pdjax.profile import (
    PUBLISHED_PROFILES,
    Profile,
    parse_graph_txt,
    published_profile,
    read_graph_txt,
)

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "pipedream-profiles"


def test_vgg16_nodes_and_total_time():
    prof = published_profile("vgg16")
    assert len(prof) == 41
    compute = [layer for layer in prof.layers if not layer.kind.startswith("Input")]
    assert len(compute) == 40
    total_ms = sum(layer.forward_seconds + layer.backward_seconds for layer in compute) * 1e3
    assert total_ms == pytest.approx(672.535, abs=1e-6)
    assert prof.layers[0].kind == "Input"
    assert prof.batch_size == 128
    assert prof.time_source == "graph.txt"
    # sorted topologically: every edge goes forwards
    assert all(a < b for a, b in prof.edges)


@pytest.mark.parametrize("model", PUBLISHED_PROFILES)
def test_every_published_profile_parses_and_round_trips(model):
    prof = published_profile(model)
    assert len(prof) > 1 and prof.has_times
    assert Profile.from_json(prof.to_json()) == prof


def test_shipped_profiles_are_the_published_ones():
    # pdjax ships PipeDream's files unchanged; compare with the copy beside the repo if any
    assert len(PUBLISHED_PROFILES) == 10
    if SHARED.is_dir():
        for model in PUBLISHED_PROFILES:
            ours = Path(published_profile(model).meta["source"]).read_bytes()
            assert ours == (SHARED / model / "graph.txt").read_bytes(), model


def test_dag_edges_are_kept():
    prof = published_profile("resnet50")
    assert not prof.is_chain
    fan_out = {}
    for a, _ in prof.edges:
        fan_out[a] = fan_out.get(a, 0) + 1
    assert max(fan_out.values()) >= 2  # residual branches


GOOD = (
    "node2 -- Linear -- forward_compute_time=1.5, backward_compute_time=3.0, "
    "activation_size=[8.0; 4.0], parameter_size=16.000\n"
    "node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, "
    "activation_size=32.0, parameter_size=0.000\n"
    "\tnode1 -- node2"
)


def test_parse_sorts_nodes_and_sums_multi_output_sizes():
    prof = parse_graph_txt(GOOD)
    assert [layer.name for layer in prof.layers] == ["node1", "node2"]
    assert prof.layers[1].output_bytes == 12 and prof.layers[1].input_bytes == 32
    assert prof.layers[1].forward_seconds == pytest.approx(1.5e-3)
    assert prof.edges == ((0, 1),)


def test_malformed_line_names_file_and_line(tmp_path):
    bad = tmp_path / "graph.txt"
    bad.write_text(GOOD.replace("forward_compute_time=1.5", "forward_time=1.5"))
    with pytest.raises(GraphFormatError, match=r"graph\.txt:1: not a node line"):
        read_graph_txt(bad)


def test_cycle_unknown_node_duplicate_and_empty():
    cycle = GOOD + "\n\tnode2 -- node1"
    with pytest.raises(GraphFormatError, match="cycle"):
        parse_graph_txt(cycle)
    with pytest.raises(GraphFormatError, match=":4: edge names unknown node node9"):
        parse_graph_txt(GOOD + "\n\tnode2 -- node9", source="g")
    with pytest.raises(GraphFormatError, match="defined twice"):
        parse_graph_txt(GOOD.splitlines()[0] + "\n" + GOOD)
    with pytest.raises(GraphFormatError, match="no nodes"):
        parse_graph_txt("\n\n")


def test_load_by_published_name():
    assert Profile.load("pipedream:vgg16") == published_profile("vgg16")
    with pytest.raises(GraphFormatError, match="available"):
        Profile.load("pipedream:vgg19")
