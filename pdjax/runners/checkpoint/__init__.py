"""Checkpoints of a training run: any runner's state (a
:class:`~pdjax.runners.RunnerState`: a :class:`PipelineState`, a
:class:`~pdjax.runners.DPState`...) plus the training loop's own metadata, saved with
orbax and restored bit for bit.

>>> import tempfile, jax, optax
>>> from pdjax.runners import DataParallel
>>> from pdjax.models import get_model
>>> spec = get_model("mlp")
>>> x, y = spec.sample_batch(8)
>>> dp = DataParallel(spec.layers, spec.loss, optax.sgd(0.1), devices=jax.devices()[:1])
>>> state, _ = dp.step(dp.init(jax.random.key(0), x), (x, y))
>>> with tempfile.TemporaryDirectory() as directory, Checkpointer(directory) as ckpt:
...     ckpt.save(1, state, extra={"epoch": 0, "batch": 1})
...     restored, extra = ckpt.restore(dp.init(jax.random.key(1), x))
>>> restored.step, extra
(1, {'epoch': 0, 'batch': 1})

On disk, ``directory/<step>/`` is one orbax ``CheckpointManager`` step with two items and
pdjax's marker:

- ``arrays/``: every array of the state (``StandardSave``, OCDBT), as a flat dict keyed
  by the array's path in the state: ``params.1.0.dense.kernel`` (field, stage, layer in
  the stage, then the layer's own tree), ``opt_state.1.0.mu.0.dense.kernel``,
  ``model_state.0.1.batch_stats.mean``, ``rng``. A typed PRNG key is stored as its
  ``jax.random.key_data`` (``uint32``). A ``DPState`` has no stage level. The arrays are
  those of the state's :data:`~pdjax.runners.protocol.ARRAY_FIELDS`. A sharded array (a
  sharded stage's weights and Adam's moments, data parallelism on an ``fsdp`` or
  ``tensor`` mesh) is written by orbax shard by shard from the devices that hold it
  (one replica of each shard); pdjax gathers none of them on the host.
- ``meta/metadata``: JSON with the format tag and version, the step, the state's type
  name, its other fields, which are Python ints
  (:func:`~pdjax.runners.protocol.counter_fields`: ``updates`` and ``microbatches`` of a
  pipeline, ``step`` of data parallelism), the layers per stage of a pipeline state
  (``stage_layers``), the shape, dtype and checksum (CRC-32 of its bytes in C order,
  dtype and shape; of a sharded array computed shard by shard and combined, the same
  value: :func:`~.format.array_checksum`) of every array (and the implementation of
  each PRNG key, e.g. ``threefry2x32``),
  ``extra``, and ``checksums``: the CRC-32 of every other field (its canonical JSON).
- ``pdjax-step.json``: ``{"format": "pdjax.checkpoint", "step": <step>}``, the marker that
  makes the folder pdjax's (:mod:`.folder`): only folders holding it (or, written before
  format 4, pdjax's metadata) are listed as steps, and only those are ever deleted.

Every restore checks each array it reads against its checksum, and the metadata against
its checksums, its step against the folder's, and every field it uses: a damaged step (a
flipped bit, a truncated or missing file, edited metadata, step folders renamed or
swapped) raises :class:`CheckpointError` naming the step, the array or field at fault and
the steps in the folder that verify, instead of restoring wrong values.
:meth:`Checkpointer.verify` runs the same checks without building a state. The metadata
of format versions 1 to 3 has no checksum: it is only checked to be usable.

Restoring needs a template, a state of the same runner (``pipe.init(...)``, or the same
tree with ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves): the checkpoint's
arrays must match its paths, shapes and dtypes, and are placed with its shardings, so a
run restarts on the devices its (new) runner uses: orbax reads each array onto the
template's sharding (each device its own part), so a state saved on one mesh restores
on another. Optimizer states come back as their own types (``ScaleByAdamState``, ...),
not lists, because the tree structure is the template's. A pipeline checkpoint also
restores into another plan (other cuts, other meshes: :func:`replan_names`) and into
data parallelism (a ``DPState`` template, as one stage holding every layer); see
:meth:`Checkpointer.restore`.

Asynchronous schedules (``pipedream``, ``2bw``) checkpoint *drain-then-save*. Each call
of :meth:`Pipeline.run` fills the pipeline and drains it, so a state between calls holds
only the newest weights of each stage: no microbatch in flight, no stashed version. That
is the only state there is to save, so the save boundary is a flush. In an unbroken
PipeDream stream, microbatch ``k`` at stage ``s`` would use the stashed version
``k - (P - s) + 1``; across the boundary the microbatches that would have been in flight
instead start the next call on the newest weights (as at the start of any call), and
``2bw``'s first step after it uses the newest weights rather than the previous ones.
The flush is a property of the calls, not of the save: a run that saves, stops,
restores and goes on with the same calls is bit for bit the run that never stopped.

Crash safety comes from orbax: a step is written into ``<step>.orbax-checkpoint-tmp``
(marked as pdjax's as it is made) and renamed to ``<step>`` once complete (the rename is
the commit), so a process killed mid-save leaves the previous steps intact, and an
unfinished temporary directory is never listed as a step (even one holding every file);
the next writer deletes it. A save that fails (a full disk) raises a
:class:`CheckpointError` (with the bytes the step needs and those free) and deletes its
own temporary folder. :meth:`Checkpointer.save` blocks until its step is committed.

One run writes a folder at a time: a writer (:meth:`Checkpointer.claim`, which
:meth:`Checkpointer.save` calls first) holds an advisory lock, ``flock`` on
``pdjax.lock`` there (holding its pid and host), until :meth:`Checkpointer.close`; a
second writer is refused, naming the holder. The lock goes with a process that dies, so
a file left behind blocks nobody. Readers take no lock. The lock file, like the marker,
is opened only as a regular file: a symbolic link there is refused, never written
through, and so are a FIFO and a device.

Several processes (``jax.distributed``): every method is collective — every process
calls it, in the same order, with the same arguments. Process 0 writes and reads the
directory alone (so it need not be shared); :meth:`Checkpointer.save` first moves each
array that it does not hold to it (another process's pipeline stage, with
``jax.device_put`` across processes, the same transport as the activations; a stage
sharded over its process's devices is first assembled whole in that process's host
memory), and :meth:`Checkpointer.restore` sends each process the arrays it holds. The
checkpoint is the same as a single process writes: a run saved by 2 processes restores
in 1 process with the same plan, and the other way round.
The write itself and the commit rename are orbax's (a ``CheckpointManager`` active on
process 0 alone), the lock and the retention pdjax's, on process 0; the others wait for
its commit.

Modules: :mod:`.checkpointer` (:class:`Checkpointer`: save, restore, verify, the steps),
:mod:`.format` (a step's metadata, format versions 1 to 4, the CRC-32 checksums),
:mod:`.folder` (which entries of the folder are pdjax's, deleting only those, the lock),
:mod:`.arrays` (a state as named arrays and metadata, and back), :mod:`.replan`
(:func:`replan_names`: a pipeline checkpoint moved into another plan or into data
parallelism), :mod:`.transfer`
(arrays between processes) and :mod:`.reads` (orbax read failures, made readable).
"""

from pdjax.runners.checkpoint.checkpointer import Checkpointer
from pdjax.runners.checkpoint.replan import replan_names

__all__ = ["Checkpointer", "replan_names"]
