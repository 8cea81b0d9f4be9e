"""Reader for PipeDream's ``graph.txt`` profiles.

One line per node, then one line per edge (tab-indented)::

    node4 -- Conv2d(3, 64, ...) -- forward_compute_time=2.5, backward_compute_time=4.1, \
activation_size=411041792.0, parameter_size=7168.0
    \tnode4 -- node5

Times are milliseconds and sizes bytes, per minibatch; a node with several outputs lists
its activation sizes as ``[a; b; c]`` (summed here). Nodes come in no particular order;
the reader sorts them topologically (Kahn's algorithm, ties broken by node number, as
PipeDream's own ``topological_sort`` on these graphs gives a stable order) and keeps every
edge, so DAGs (ResNet, GNMT, Inception) stay DAGs.

The batch size behind a profile is not written in the file, and a file holds no shapes,
only bytes; PipeDream's profiler writes ``4 * (product of the output's shape)`` for every
output (4 bytes an element whatever the dtype, the batch dimension included). The reader
takes, in this order (``meta["batch_size_from"]`` says which):

1. ``batch_size=`` when given (> 0): ``"given"``.
2. Image inputs: an ``Input`` node whose size is a whole number of 3x224x224 (or, for
   Inception-v3, 3x299x299) fp32 images: that number (VGG-16: 128), ``"image input"``.
3. Token inputs (GNMT): their ``Input`` nodes have size 0 and a ``[seq, batch]`` or
   ``[batch, seq]`` token tensor could not be told apart anyway, so the batch is read off a
   recurrent layer's state instead, which has one layout: an ``LSTM(in, hidden, ...)`` (or
   ``GRU``) node's outputs are ``[output; h; c]`` with ``h`` (and ``c``) of shape
   ``[num_layers * directions, batch, hidden]``, so ``batch = bytes(h) / (4 * num_layers *
   directions * hidden)``. It counts only when the output is then a whole number of steps
   (``bytes(output) = 4 * steps * batch * directions * hidden``) and every such node
   agrees: ``"recurrent state"``. GNMT (``gnmt``): ``h`` of ``LSTM(1024, 1024)`` is 131072
   bytes, batch 32 (48-token sources; the decoder's 47-step outputs and the attention
   scores, 288768 bytes = 4 x 32 x 47 x 48, agree); ``gnmt_large``: 524288 bytes, batch
   128 (25 steps; scores 320000 = 4 x 128 x 25 x 25).
4. Otherwise 1: ``"unknown"`` (pass ``batch_size=``).
"""

from __future__ import annotations

import heapq
import math
import re
from pathlib import Path

from pdjax._jsonio import read_text
from pdjax.errors import GraphFormatError
from pdjax.profile.profile import LayerProfile, Profile

__all__ = ["PUBLISHED_PROFILES", "parse_graph_txt", "published_profile", "read_graph_txt"]

_PUBLISHED_DIR = Path(__file__).with_name("pipedream_profiles")

#: PipeDream's published GPU profiles shipped with pdjax (MIT licence, see that folder).
PUBLISHED_PROFILES: tuple[str, ...] = tuple(
    sorted(p.name for p in _PUBLISHED_DIR.iterdir() if (p / "graph.txt").is_file())
)

_NODE = re.compile(
    r"^(?P<id>node\d+) -- (?P<desc>.*) -- "
    r"forward_compute_time=(?P<fwd>[-+0-9.eE]+), "
    r"backward_compute_time=(?P<bwd>[-+0-9.eE]+), "
    r"activation_size=(?P<act>[-+0-9.eE]+|\[[-+0-9.eE; ]*\]), "
    r"parameter_size=(?P<param>[-+0-9.eE]+)$"
)
_EDGE = re.compile(r"^\s+(?P<a>node\d+) -- (?P<b>node\d+)$")
#: One node: ``(description, forward ms, backward ms, output bytes, parameter bytes)``.
_Node = tuple[str, float, float, float, float]
#: One edge: ``(from node, to node, line number)``.
_Edge = tuple[str, str, int]


def _sizes(text: str) -> tuple[float, ...]:
    # A node with several outputs (an LSTM's output and state) lists them: "[a; b; c]".
    if text.startswith("["):
        return tuple(float(part) for part in text[1:-1].split(";") if part.strip())
    return (float(text),)


def _node_number(node_id: str) -> int:
    return int(node_id[len("node") :])


def parse_graph_txt(
    text: str, *, source: str = "<string>", batch_size: int = 0, require_connected: bool = False
) -> Profile:
    """Parses the text of a ``graph.txt`` into a :class:`Profile`.

    Args:
      text: the file's contents.
      source: the file name, used in error messages and ``meta["source"]``.
      batch_size: samples per minibatch behind the profile; 0 infers it (from an image
        input node, else a recurrent layer's state, else 1: see the module doc).
      require_connected: refuse a graph that is not one connected network (a file cut
        short at a line boundary loses its edges). The file readers (:func:`read_graph_txt`,
        :meth:`Profile.load`) ask for it; a text fragment (a few nodes, for a test) need
        not be whole.

    Returns:
      A profile whose seconds are PipeDream's milliseconds / 1000, ``time_source``
      ``"graph.txt"``. Input nodes (``Input``, ``Input0``, ...) are kept as layers with
      the times PipeDream recorded for them (VGG-16's ``Input`` has 17.97 ms of forward
      time: loading the batch); the planner, like PipeDream's optimizer, treats them as
      free sources.

    Raises:
      GraphFormatError: a malformed line, a negative or non-finite number (with file and
        line number), a duplicate node, an edge to an unknown node, a cycle, with
        ``require_connected``, a node not connected to the rest (a file cut short), or no
        nodes at all.
    """
    nodes, outputs, edges = _parse_lines(text, source)
    order = _topological_order(nodes, edges, source)
    if require_connected:
        _check_connected(nodes, edges, source)
    index = {n: i for i, n in enumerate(order)}
    layers = _layer_profiles(nodes, edges, order, index)
    if batch_size > 0:
        batch_from = "given"
    else:
        batch_size, batch_from = _infer_batch_size(
            layers, [(nodes[n][0], outputs[n]) for n in order]
        )
    edge_idx = sorted({(index[a], index[b]) for a, b, _ in edges})
    return Profile(
        layers=tuple(layers),
        edges=tuple(edge_idx),
        batch_size=batch_size,
        time_source="graph.txt",
        meta={"source": source, "format": "pipedream graph.txt", "batch_size_from": batch_from},
    )


def _parse_lines(
    text: str, source: str
) -> tuple[dict[str, _Node], dict[str, tuple[float, ...]], list[_Edge]]:
    """The nodes, each node's output sizes, and the edges of a ``graph.txt``'s text, every
    line checked and every edge's ends known."""
    nodes: dict[str, _Node] = {}
    outputs: dict[str, tuple[float, ...]] = {}  # per node, its outputs' sizes
    edges: list[_Edge] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        m = _NODE.match(line)
        if m:
            if m["id"] in nodes:
                raise GraphFormatError(f"{source}:{lineno}: node {m['id']} is defined twice")
            nodes[m["id"]], outputs[m["id"]] = _parse_node(m, f"{source}:{lineno}", line)
            continue
        m = _EDGE.match(line)
        if m:
            edges.append((m["a"], m["b"], lineno))
            continue
        shown = line if len(line) <= 80 else line[:77] + "..."
        raise GraphFormatError(
            f"{source}:{lineno}: not a node line ('nodeN -- desc -- forward_compute_time=..., "
            f"backward_compute_time=..., activation_size=..., parameter_size=...') nor an "
            f"edge line ('\\tnodeA -- nodeB'): {shown!r}"
        )
    if not nodes:
        raise GraphFormatError(f"{source}: no nodes")
    for a, b, lineno in edges:
        for n in (a, b):
            if n not in nodes:
                raise GraphFormatError(f"{source}:{lineno}: edge names unknown node {n}")
    return nodes, outputs, edges


def _parse_node(m: re.Match[str], where: str, line: str) -> tuple[_Node, tuple[float, ...]]:
    """A matched node line's node and output sizes; ``where`` is ``file:line``."""
    try:
        sizes = _sizes(m["act"])
        values = (float(m["fwd"]), float(m["bwd"]), sum(sizes), float(m["param"]))
    except ValueError as e:
        raise GraphFormatError(f"{where}: bad number: {e}") from e
    if any(v < 0 for v in (*values, *sizes)):
        raise GraphFormatError(f"{where}: negative time or size")
    if not all(math.isfinite(v) for v in (*values, *sizes)):
        # "1e999" parses as inf, and would price a stage at infinity (or NaN).
        raise GraphFormatError(f"{where}: a time or size is too large to be finite: {line[:80]!r}")
    return (m["desc"].strip(), *values), sizes


def _topological_order(nodes: dict[str, _Node], edges: list[_Edge], source: str) -> list[str]:
    """The nodes in topological order (Kahn's algorithm, ties broken by node number).

    Raises:
      GraphFormatError: for a cycle.
    """
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    indeg = dict.fromkeys(nodes, 0)
    for a, b, _ in edges:
        succ[a].append(b)
        indeg[b] += 1
    ready = [(_node_number(n), n) for n, d in indeg.items() if d == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for b in succ[n]:
            indeg[b] -= 1
            if indeg[b] == 0:
                heapq.heappush(ready, (_node_number(b), b))
    if len(order) != len(nodes):
        stuck = sorted((n for n in nodes if n not in set(order)), key=_node_number)
        raise GraphFormatError(f"{source}: the graph has a cycle through {stuck[:6]}")
    return order


def _layer_profiles(
    nodes: dict[str, _Node], edges: list[_Edge], order: list[str], index: dict[str, int]
) -> list[LayerProfile]:
    """One layer per node, in ``order`` (``index`` maps a node to its place there), seconds
    from PipeDream's milliseconds and input bytes from the predecessors' outputs."""
    layers = []
    for n in order:
        desc, fwd, bwd, act, param = nodes[n]
        layers.append(
            LayerProfile(
                name=n,
                kind=desc,
                param_bytes=int(param),
                output_bytes=int(act),
                forward_seconds=fwd / 1e3,
                backward_seconds=bwd / 1e3,
            )
        )
    # PipeDream's "activation_size" is the node's output; a node's input is the output of
    # its predecessors, which fills input_bytes (and so the stash estimate).
    preds: dict[int, list[int]] = {}
    for a, b, _ in edges:
        preds.setdefault(index[b], []).append(index[a])
    return [
        _with_input(layer, sum(layers[p].output_bytes for p in preds.get(i, [])))
        for i, layer in enumerate(layers)
    ]


def _check_connected(nodes: dict[str, _Node], edges: list[_Edge], source: str) -> None:
    """Raises GraphFormatError unless every node is linked (ignoring direction) to the first
    input node: one network. A file cut short at a line boundary parses line by line, but
    loses edges (every one, when cut among the node lines) and so leaves nodes that
    nothing feeds and that feed nothing; planning them would price a different network.
    A network may have several inputs and outputs (GNMT, Inception's auxiliary head), so
    this asks only for one connected piece."""
    neighbours: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b, _ in edges:
        neighbours[a].append(b)
        neighbours[b].append(a)
    inputs = [n for n in nodes if nodes[n][0].startswith("Input")]
    start = min(inputs or nodes, key=_node_number)
    seen, todo = {start}, [start]
    while todo:
        for m in neighbours[todo.pop()]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    if len(seen) != len(nodes):
        cut = sorted((n for n in nodes if n not in seen), key=_node_number)
        raise GraphFormatError(
            f"{source}: node {cut[0]} ({nodes[cut[0]][0][:40]}) is not connected to "
            f"{start} ({len(cut)} of {len(nodes)} nodes are cut off): the file may be cut "
            "short (a graph.txt lists every node, then every edge); use the complete file"
        )


def _with_input(layer: LayerProfile, input_bytes: int) -> LayerProfile:
    from dataclasses import replace

    return replace(layer, input_bytes=int(input_bytes))


def _infer_batch_size(
    layers: list[LayerProfile], outputs: list[tuple[str, tuple[float, ...]]]
) -> tuple[int, str]:
    """The batch size and how it was found (the module doc's rules 2-4)."""
    for side in (224, 299):  # ImageNet crops: most models, Inception-v3
        image = 3 * side * side * 4
        for layer in layers:
            if layer.kind.startswith("Input") and layer.output_bytes % image == 0:
                if layer.output_bytes:
                    return layer.output_bytes // image, "image input"
    found = {b for desc, sizes in outputs if (b := _recurrent_batch(desc, sizes)) is not None}
    if len(found) == 1:
        return found.pop(), "recurrent state"
    return 1, "unknown"


_RECURRENT = re.compile(
    r"^(?:LSTM|GRU)\((?P<input>\d+), (?P<hidden>\d+)(?P<options>(?:, [^()]*)?)\)$"
)


def _recurrent_batch(desc: str, sizes: tuple[float, ...]) -> int | None:
    """The batch of an ``LSTM``/``GRU`` node from its state's size (``[output; h(; c)]``,
    ``h`` of shape ``[num_layers * directions, batch, hidden]``), or None if the node is
    not one or its sizes do not fit that layout.

    >>> _recurrent_batch("LSTM(1024, 1024)", (6291456.0, 131072.0, 131072.0))
    32
    >>> _recurrent_batch("LSTM(8, 4, num_layers=2, bidirectional=True)", (4 * 5 * 3 * 8,
    ...                  4 * 4 * 3 * 4, 4 * 4 * 3 * 4))
    3
    >>> _recurrent_batch("LSTM(1024, 1024)", (6291456.0,)) is None  # no state listed
    True
    """
    m = _RECURRENT.match(desc)
    if not m or len(sizes) < 2:
        return None
    hidden = int(m["hidden"])
    options: dict[str, str] = {}
    for part in m["options"].split(","):
        key, eq, value = part.partition("=")
        if eq:
            options[key.strip()] = value.strip()
    try:
        layers = int(options.get("num_layers", "1"))
    except ValueError:
        return None
    directions = 2 if options.get("bidirectional") == "True" else 1
    if options.get("proj_size", "0") != "0" or hidden < 1 or layers < 1:
        return None  # h would be [.., batch, proj_size]: not worth the guess
    per_sample = 4 * layers * directions * hidden
    state = sizes[1:]
    if any(size != state[0] for size in state) or state[0] <= 0 or state[0] % per_sample:
        return None
    batch = int(state[0] // per_sample)
    step = 4 * batch * directions * hidden  # one step of the output, [.., batch, dirs * hidden]
    if sizes[0] <= 0 or sizes[0] % step:
        return None
    return batch


def read_graph_txt(path: str | Path, *, batch_size: int = 0) -> Profile:
    """Reads a PipeDream ``graph.txt`` file. See :func:`parse_graph_txt`."""
    text = read_text(path, "graph.txt", GraphFormatError)
    return parse_graph_txt(text, source=str(path), batch_size=batch_size, require_connected=True)


def published_profile(name: str, *, batch_size: int = 0) -> Profile:
    """One of PipeDream's published profiles by model name, e.g. ``"vgg16"``;
    ``batch_size`` as for :func:`parse_graph_txt` (0: inferred).

    >>> [(m, published_profile(m).batch_size) for m in ("vgg16", "gnmt", "gnmt_large")]
    [('vgg16', 128), ('gnmt', 32), ('gnmt_large', 128)]

    Raises:
      GraphFormatError: for an unknown name, listing the available ones.
    """
    if name not in PUBLISHED_PROFILES:
        raise GraphFormatError(
            f"no published PipeDream profile {name!r}; available: {list(PUBLISHED_PROFILES)}"
        )
    return read_graph_txt(_PUBLISHED_DIR / name / "graph.txt", batch_size=batch_size)
