"""Stage measurement: each candidate stage timed as the runtime's own compiled programs
(forward, backward, update) on one of its devices, and the model fingerprint a
calibration records.

The update is timed as the pipeline runs it: after the backward, on the gradient the
backward just made (donated: its buffer becomes the new weights), beside older weight
versions kept alive as a stashing schedule keeps them. Timed alone, on copies of one
gradient with nothing else alive, an update read about half what it costs in a pipeline
(0.34 ms against 0.78 ms)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

from pdjax._timing import median_seconds
from pdjax.calibrate.calibration import StageMeasure
from pdjax.errors import CalibrationError

__all__ = ["VERSIONS_HELD", "measure_stages", "model_fingerprint"]

#: Weight versions a stage holds while its update is timed: the newest, which the update
#: replaces, and one older version that a schedule stashes for backwards in flight (2bw
#: holds two; PipeDream's stage ``s`` of ``P`` holds ``P - s``; on CPU a flush schedule's
#: update, which does not donate the weights it replaces, also holds two while it runs).
VERSIONS_HELD = 2


def model_fingerprint(layers: Any, sample: Any) -> dict[str, Any]:
    """``{"layers": names, "param_bytes": per layer}`` of a layer sequence (shapes only)."""
    import jax
    import numpy as np

    shapes = jax.eval_shape(layers.init, jax.random.key(0), sample)
    sizes = [
        int(sum(np.prod(a.shape, dtype=np.int64) * a.dtype.itemsize
                for a in jax.tree.leaves(v.get("params", {}))))
        for v in shapes
    ]  # fmt: skip
    return {"layers": list(layers.names), "param_bytes": sizes}


def measure_stages(
    layers: Any,
    sample: Any,
    loss: Callable[[Any, Any], Any],
    optimizer: Any,
    stages: Iterable[tuple[int, int, int, str]],
    *,
    device: Any = None,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    versions: int = VERSIONS_HELD,
    log: Callable[[str], None] = lambda s: None,
) -> list[StageMeasure]:
    """Times each stage ``(first, last, replicas, replication)`` on ``device``.

    ``sample`` is one microbatch ``(x, y)``. A split stage on ``r`` devices is timed at
    ``b / r`` rows (one device's share; ``b`` must divide); a round-robin one at ``b`` rows,
    divided by ``r``. See the module doc for what each program holds. The backward and the
    update are timed together, the update on the gradient the backward just made, with
    ``versions`` weight versions alive (default :data:`VERSIONS_HELD`).

    Raises:
      CalibrationError: a stage outside the model, an unknown replication, a microbatch a
        split stage cannot divide, or ``versions`` below 1.
    """
    import jax

    if isinstance(versions, bool) or not isinstance(versions, int) or versions < 1:
        raise CalibrationError(f"versions must be a whole number of weight versions >= 1, got "
                               f"{versions!r}")  # fmt: skip
    device = device or jax.devices()[0]
    x, y = sample
    b = int(jax.tree.leaves(x)[0].shape[0])
    variables, acts = _stage_inputs(layers, x, device, seed)
    run = _StageRun(
        layers=layers,
        targets=y,
        loss=loss,
        optimizer=optimizer,
        variables=variables,
        acts=acts,
        key=jax.device_put(jax.random.key(seed + 1), device),
        device=device,
        warmup=warmup,
        repeats=repeats,
        versions=versions,
    )
    out: list[StageMeasure] = []
    for first, last, r, mode in stages:
        mode = _checked_mode(first, last, r, mode, num_layers=len(layers), batch=b)
        rows = b // r if mode == "split" else b
        m = _measure_stage(run, first, last, r, mode, rows=rows)
        log(f"stage {first}-{last} x{r} {mode}: F {m.forward * 1e3:.2f} ms, "
            f"B {m.backward * 1e3:.2f} ms, U {m.update * 1e3:.2f} ms")  # fmt: skip
        out.append(m)
    return out


def _stage_inputs(layers: Any, x: Any, device: Any, seed: int) -> tuple[list[Any], list[Any]]:
    """The weights and every layer's input (the sample's, then each layer's output), once,
    at the whole microbatch, on ``device``."""
    import jax

    with jax.default_device(device):
        variables = jax.jit(layers.init)(jax.random.key(seed), x)
        acts = [jax.device_put(x, device)]
        for i, layer in enumerate(layers.layers):
            act, _ = jax.jit(lambda v, a, layer=layer: layer.apply(v, a, train=False))(
                variables[i], acts[-1]
            )
            acts.append(act)
    return variables, acts


def _checked_mode(first: int, last: int, r: int, mode: str, *, num_layers: int, batch: int) -> str:
    """The stage's replication mode (``"split"`` on one device), the stage checked against
    the model's ``num_layers`` and the microbatch's ``batch`` rows."""
    if not (0 <= first <= last < num_layers):
        raise CalibrationError(f"stage {first}-{last} is outside the model's {num_layers} layers")
    mode = "split" if r == 1 else mode
    if mode not in ("split", "round-robin"):
        raise CalibrationError(f"replication must be 'split' or 'round-robin'; got {mode!r}")
    if mode == "split" and batch % r:
        raise CalibrationError(
            f"stage {first}-{last} split over {r} devices: the microbatch ({batch}) must be a "
            f"multiple of {r}"
        )
    return mode


@dataclasses.dataclass(frozen=True)
class _StageRun:
    """What every stage of one :func:`measure_stages` call is measured with.

    Attributes:
      layers, targets, loss, optimizer: the model, the microbatch's targets, the loss and
        the optimizer.
      variables, acts: every layer's weights and input (:func:`_stage_inputs`).
      key: the PRNG key the programs take, on ``device``.
      device: where the stages run.
      warmup, repeats: untimed and timed runs of each program.
      versions: weight versions alive while the update runs (:func:`measure_stages`).
    """

    layers: Any
    targets: Any
    loss: Callable[[Any, Any], Any]
    optimizer: Any
    variables: list[Any]
    acts: list[Any]
    key: Any
    device: Any
    warmup: int
    repeats: int
    versions: int


def _measure_stage(
    run: _StageRun, first: int, last: int, r: int, mode: str, *, rows: int
) -> StageMeasure:
    """One stage timed as the runtime's own programs for it on one device (unfused: F, B,
    U), on ``rows`` samples."""
    import jax
    import jax.numpy as jnp

    from pdjax.layers import LayerSequence
    from pdjax.pipeline import Stage

    device, warmup, repeats = run.device, run.warmup, run.repeats
    is_last, is_first = last == len(run.layers) - 1, first == 0
    sub = LayerSequence(tuple(run.layers.layers[first : last + 1]))
    params = [v.get("params", {}) for v in run.variables[first : last + 1]]
    rest = [{k: a for k, a in v.items() if k != "params"} for v in run.variables[first : last + 1]]
    xin = jax.tree.map(lambda a, n=rows: a[:n], run.acts[first])
    tgt = jax.tree.map(lambda a, n=rows: jnp.asarray(a[:n]), run.targets)
    stage = Stage(
        index=0 if is_first else 1,
        layers=sub.layers,
        first_layer=first,
        devices=(device,),
        optimizer=run.optimizer,
        loss_fn=run.loss if is_last else None,
    )
    w, st, key_ = jax.device_put((params, rest, run.key), device)
    xin = jax.device_put(xin, device)
    tail: tuple[Any, ...] = (jax.device_put(tgt, device),) if is_last else ()
    f_prog, b_prog = stage.program("F"), stage.program("B")
    _, _, kept = f_prog(w, st, xin, key_, *tail)
    if is_last:
        ct: tuple[Any, ...] = ()
    else:
        ct = (jax.device_put(
            jax.tree.map(lambda a, n=rows: jnp.ones_like(a[:n]) * 1e-3, run.acts[last + 1]),
            device,
        ),)  # fmt: skip
    t_f = median_seconds(functools.partial(f_prog, w, st, xin, key_, *tail), warmup, repeats)

    def backward(weights: Any) -> Any:
        return b_prog(weights, xin, kept, *ct)

    if jax.tree.leaves(params):
        t_b, t_u = _backward_update_seconds(stage, backward, w, warmup, repeats, run.versions)
    else:  # nothing to update
        t_b, t_u = median_seconds(functools.partial(backward, w), warmup, repeats), 0.0
    per = 1.0 / r if mode == "round-robin" else 1.0
    return StageMeasure(
        first=first,
        last=last,
        replicas=r,
        replication=mode,
        forward=round(t_f * per, 9),
        backward=round(t_b * per, 9),
        update=round(t_u, 9),
        allreduce=None,
        rows=rows,
    )


def _backward_update_seconds(
    stage: Any,
    backward: Callable[[Any], Any],
    w: Any,
    warmup: int,
    repeats: int,
    versions: int,
) -> tuple[float, float]:
    """Median seconds of the stage's backward and of the update after it, timed as the
    runtime runs them: ``B``, then ``U`` on the gradient ``B`` just made.

    ``U`` donates the gradient (its buffer takes the new weights' place) and the optimizer
    state, and writes the new weights beside the ones it replaces, as the runtime's ``U``
    does (on CPU the replaced weights are never donated: :mod:`pdjax._xla_cpu`). The
    ``versions`` newest weight versions stay alive, as a schedule that stashes them keeps
    them; ``B`` reads the oldest (the version its forward used, under PipeDream's
    stashing), ``U`` replaces the newest and the oldest is dropped (see the module doc for
    what timing the update alone missed)."""
    import collections

    import jax

    u_prog = stage.program("U")
    opt = jax.jit(stage.optimizer.init)(w)
    held = collections.deque([jax.tree.map(lambda a: a.copy(), w)], maxlen=versions)
    jax.block_until_ready((held[0], opt))
    t_b, t_u = [], []
    for _ in range(warmup + repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(backward(held[0]))
        t1 = time.perf_counter()
        new_w, opt = jax.block_until_ready(u_prog(out[0], held[-1], opt)[:2])
        t2 = time.perf_counter()
        held.append(new_w)
        del out, new_w  # the gradient's buffer is the new weights' now
        t_b.append(t1 - t0)
        t_u.append(t2 - t1)
    return statistics.median(t_b[warmup:]), statistics.median(t_u[warmup:])
