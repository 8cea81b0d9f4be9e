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


# -- batch size -----------------------------------------------------------------------

IMAGE_BATCH = {
    "alexnet": 256,
    "densenet121": 64,
    "inception_v3": 128,
    "resnet101": 64,
    "resnet18": 256,
    "resnet50": 128,
    "squeezenet1_0": 256,
    "vgg16": 128,
}


@pytest.mark.parametrize("model", sorted(IMAGE_BATCH))
def test_image_profiles_batch_from_the_input_node(model):
    prof = published_profile(model)
    assert prof.batch_size == IMAGE_BATCH[model]
    assert prof.meta["batch_size_from"] == "image input"


@pytest.mark.parametrize(
    ("model", "batch", "src", "tgt"), [("gnmt", 32, 48, 47), ("gnmt_large", 128, 25, 25)]
)
def test_gnmt_batch_from_the_lstm_state(model, batch, src, tgt):
    # Token inputs carry no size (Input0..2 are 0 bytes); an LSTM(1024, 1024)'s h and c
    # are [1, batch, 1024] fp32. The other nodes agree: the encoder embedding is
    # [src, batch, 1024], the classifier [tgt, batch, 32320] (the decoder sees tgt[:-1]).
    prof = published_profile(model)
    assert [x.output_bytes for x in prof.layers if x.kind.startswith("Input")] == [0, 0, 0]
    assert prof.batch_size == batch
    assert prof.meta["batch_size_from"] == "recurrent state"
    text = Path(prof.meta["source"]).read_text()
    assert "LSTM(1024, 1024) -- " in text
    state = f"{4.0 * batch * 1024}; {4.0 * batch * 1024}]"
    lstms = [line for line in text.splitlines() if line.startswith("node") and "-- LSTM(" in line]
    assert lstms and all(state in line for line in lstms)
    encoder = next(x for x in prof.layers if x.kind.startswith("Embedding"))
    classifier = next(x for x in prof.layers if x.kind.startswith("Classifier"))
    assert encoder.output_bytes == 4 * src * batch * 1024
    assert classifier.output_bytes == 4 * tgt * batch * 32320
    # the attention scores, the RecurrentAttention's last output: [batch, tgt, src]
    assert f"; {4.0 * batch * tgt * src}], parameter_size" in text


def test_batch_size_override_and_unknown():
    path = Path(published_profile("gnmt").meta["source"])
    for prof in (published_profile("gnmt", batch_size=64), read_graph_txt(path, batch_size=64)):
        assert prof.batch_size == 64 and prof.meta["batch_size_from"] == "given"
    assert published_profile("vgg16", batch_size=32).batch_size == 32
    plain = parse_graph_txt(GOOD)  # no image input, no recurrent layer
    assert plain.batch_size == 1 and plain.meta["batch_size_from"] == "unknown"


def _rnn_line(n, desc, sizes):
    act = "[" + "; ".join(f"{s:.1f}" for s in sizes) + "]"
    return (
        f"node{n} -- {desc} -- forward_compute_time=1.0, backward_compute_time=2.0, "
        f"activation_size={act}, parameter_size=16.0"
    )


def test_recurrent_rules_on_small_graphs():
    # a GRU's [output; h], batch-first or not (h is [layers * dirs, batch, hidden] either
    # way); a bidirectional 2-layer LSTM
    gru = _rnn_line(2, "GRU(8, 16, batch_first=True)", [4 * 3 * 5 * 16, 4 * 3 * 16])
    assert parse_graph_txt(GOOD.splitlines()[1] + "\n" + gru).batch_size == 3
    bi = _rnn_line(
        2,
        "LSTM(8, 16, num_layers=2, bidirectional=True)",
        [4 * 7 * 6 * 32, 4 * 4 * 6 * 16, 4 * 4 * 6 * 16],
    )
    assert parse_graph_txt(bi).batch_size == 6
    # two recurrent layers that disagree, or sizes that fit no batch: no guess
    other = _rnn_line(3, "LSTM(16, 16)", [4 * 7 * 5 * 16, 4 * 5 * 16, 4 * 5 * 16])
    assert parse_graph_txt(bi + "\n" + other).meta["batch_size_from"] == "unknown"
    odd = _rnn_line(2, "LSTM(8, 16)", [4 * 7 * 6 * 16 + 4, 4 * 6 * 16, 4 * 6 * 16])
    assert parse_graph_txt(odd).batch_size == 1
