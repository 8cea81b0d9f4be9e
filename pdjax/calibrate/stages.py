"""Stage measurement: each candidate stage timed as the runtime's own compiled programs
(forward, backward, update) on one of its devices, and the model fingerprint a
calibration records."""

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

__all__ = ["measure_stages", "model_fingerprint"]


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
    log: Callable[[str], None] = lambda s: None,
) -> list[StageMeasure]:
    """Times each stage ``(first, last, replicas, replication)`` on ``device``.

    ``sample`` is one microbatch ``(x, y)``. A split stage on ``r`` devices is timed at
    ``b / r`` rows (one device's share; ``b`` must divide); a round-robin one at ``b`` rows,
    divided by ``r``. See the module doc for what each program holds.
    """
    import jax

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
    t_b = median_seconds(functools.partial(b_prog, w, xin, kept, *ct), warmup, repeats)
    t_u = 0.0
    if jax.tree.leaves(params):
        grads = b_prog(w, xin, kept, *ct)[0]
        t_u = _update_seconds(stage, grads, w, warmup, repeats)
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


def _update_seconds(stage: Any, grads: Any, w: Any, warmup: int, repeats: int) -> float:
    """Median seconds of the stage's update program on gradients ``grads`` and weights
    ``w``.

    U takes the gradient sum and the optimizer state (donated) and returns new weights
    beside the old ones, which the schedule may still read: fresh inputs for every call,
    made outside the timed region."""
    import jax
    import jax.numpy as jnp

    u_prog = stage.program("U")
    opt0 = jax.jit(stage.optimizer.init)(w)
    inputs = [jax.tree.map(jnp.copy, (grads, opt0)) for _ in range(warmup + repeats)]
    jax.block_until_ready(inputs)
    times = []
    for g_i, o_i in inputs:
        t0 = time.perf_counter()
        jax.block_until_ready(u_prog(g_i, w, o_i))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])
