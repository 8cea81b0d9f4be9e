"""A run's optimizer (:func:`build_optimizer`): a named optax optimizer (``adam``,
``adamw``, ``sgd``, ``momentum``) or one of your own (``package.module:fn`` returning an
:class:`optax.GradientTransformation`, or naming one), its learning rate constant or a
schedule (``warmup-cosine``), with global-norm clipping of the gradients before it.

Every setting given must reach the optimizer: an optimizer of your own that takes no
learning rate (an optax object, or a function without a ``learning_rate`` parameter)
refuses ``learning_rate`` and ``lr_schedule``, and a number that float32 (the parameters' dtype)
holds as 0, as a subnormal or as infinity is refused (:func:`check_settings`)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import os
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import optax

from pdjax.apps.train.wording import in_command_line, setting
from pdjax.errors import LaunchInterrupted, PdjaxError, PipelineError
from pdjax.models.spec import DEBUG_HINT, describe_failure
from pdjax.precision import loss_scaled

if TYPE_CHECKING:
    from pdjax.apps.train.config import TrainConfig

#: The optimizers a name gives (any other ``optimizer`` is ``package.module:fn``).
OPTIMIZERS = ("adam", "adamw", "sgd", "momentum")
#: The learning-rate schedules: ``constant``, or a linear warmup from 0 to the learning
#: rate over ``warmup_steps`` updates then a cosine decay to 0 (``warmup-cosine``).
LR_SCHEDULES = ("constant", "warmup-cosine")
#: The learning rate of a named optimizer, or of a function of your own that takes one,
#: where none is given.
DEFAULT_LEARNING_RATE = 1e-3
#: float32, the dtype of the parameters and of the optimizer's arithmetic in every
#: precision: a step size, norm or decay rate must be a normal number of it.
_FLOAT32 = np.finfo(np.float32)
#: What a function of your own returned, per (its id, learning rate): called once per
#: process for each learning rate, every check and run reuses it (:func:`load_optimizer`).
_MADE: dict[tuple[int, Any], tuple[Any, optax.GradientTransformation]] = {}
_MADE_MAX = 16


def is_optimizer_ref(name: str) -> bool:
    """Whether ``name`` names an optimizer factory (``package.module:fn``)."""
    return ":" in name


def _named(ref: str) -> str:
    """The setting ``optimizer=ref`` in a message (``--optimizer 'ref'`` on the command
    line: :func:`~pdjax.apps.train.wording.setting`)."""
    return setting("optimizer", ref, quote=True)


def check_optimizer_name(name: str) -> None:
    """Checks the form of ``name`` without importing anything.

    Raises:
      PipelineError: naming the optimizers and the factory form.
    """
    if is_optimizer_ref(name):
        module, _, attr = name.rpartition(":")
        if not module.strip() or not attr.strip():
            raise PipelineError(
                f"{_named(name)}: an optimizer factory is written package.module:fn "
                "(or path/to/file.py:fn), with both parts"
            )
        return
    if name not in OPTIMIZERS:
        raise PipelineError(
            f"unknown optimizer {name!r}; choose {', '.join(OPTIMIZERS[:-1])} or "
            f"{OPTIMIZERS[-1]}, or give your own as package.module:fn, a function returning "
            "an optax.GradientTransformation"
        )


def make_optimizer(
    name: str, learning_rate: float | optax.Schedule, weight_decay: float | None = None
) -> optax.GradientTransformation:
    """The optimizer a CLI name means: ``adam``, ``adamw`` (decoupled ``weight_decay``,
    optax's default 1e-4 when None), ``momentum`` (SGD, 0.9) or ``sgd``."""
    if name == "adam":
        return optax.adam(learning_rate)
    if name == "adamw":
        if weight_decay is None:
            return optax.adamw(learning_rate)
        return optax.adamw(learning_rate, weight_decay=weight_decay)
    if name == "momentum":
        return optax.sgd(learning_rate, momentum=0.9)
    return optax.sgd(learning_rate)


def learning_rate(cfg: TrainConfig, total_updates: int) -> float | optax.Schedule:
    """``cfg``'s learning rate: a number (``constant``), or for ``warmup-cosine`` a
    schedule over ``cfg.decay_steps`` updates (warmup included), else ``total_updates``
    (the same settings give the same schedule object)."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    return _warmup_cosine(cfg.lr, cfg.warmup_steps, decay_length(cfg, total_updates))


@functools.lru_cache(maxsize=32)
def _warmup_cosine(peak: float, warmup: int, length: int) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup, decay_steps=length, end_value=0.0
    )


def decay_length(cfg: TrainConfig, total_updates: int) -> int:
    """The updates a ``warmup-cosine`` schedule runs over, warmup included:
    ``cfg.decay_steps``, else the run's ``total_updates`` (at least ``warmup_steps + 1``).

    Raises:
      PipelineError: the schedule ends before the run does (``decay_steps`` below the
        run's ``total_updates``: the learning rate would be 0 for the rest), or the run's
        updates do not outlast the warmup (without ``decay_steps``).
    """
    if cfg.decay_steps is not None:
        if cfg.decay_steps < total_updates:
            idle = total_updates - cfg.decay_steps
            raise PipelineError(
                f"{setting('decay_steps', cfg.decay_steps)}: the warmup-cosine schedule "
                "reaches a "
                f"learning rate of 0 at update {cfg.decay_steps}, and the run makes "
                f"{total_updates} optimizer updates in its {_epochs(cfg)}, so its last "
                f"{idle} would not train; a schedule must last the whole run: give "
                f"{setting('decay_steps', total_updates)} or more, leave it out (the schedule then "
                "spans the run), or train fewer epochs"
            )
        return cfg.decay_steps
    if total_updates <= cfg.warmup_steps:
        raise PipelineError(
            f"{setting('lr_schedule', 'warmup-cosine')}: the run makes {total_updates} "
            f"optimizer updates in its {_epochs(cfg)}, not more than "
            f"{setting('warmup_steps', cfg.warmup_steps)}, "
            f"so no decay would follow the warmup: lower {setting('warmup_steps')}, train "
            f"more epochs, or give {setting('decay_steps')}"
        )
    return total_updates


def _epochs(cfg: TrainConfig) -> str:
    return f"{cfg.epochs} epoch{'s' if cfg.epochs > 1 else ''}"


def build_optimizer(cfg: TrainConfig, total_updates: int) -> optax.GradientTransformation:
    """``cfg``'s optimizer for a run of ``total_updates`` updates: the named one or the
    factory's (:func:`load_optimizer`) with :func:`learning_rate`, after global-norm
    clipping of the gradients (``cfg.clip_norm``).

    Raises:
      PipelineError: a factory that cannot be loaded or returns no transformation, an
        optimizer of your own that takes no learning rate given learning-rate settings, or
        a schedule that the run's updates do not outlast or that ends before the run does.
    """
    if is_optimizer_ref(cfg.optimizer):
        given = learning_rate_options(cfg)
        # settings that cannot reach it are refused first, before the schedule's checks
        _refuse_unreachable(cfg.optimizer, resolve_optimizer(cfg.optimizer), given)
        base = load_optimizer(cfg.optimizer, learning_rate(cfg, total_updates), given=given)
    else:
        base = make_optimizer(cfg.optimizer, learning_rate(cfg, total_updates), cfg.weight_decay)
    opt = (
        base
        if cfg.clip_norm is None
        else optax.chain(optax.clip_by_global_norm(cfg.clip_norm), base)
    )
    if cfg.precision == "f16":  # the gradients are the scaled loss's: unscale first
        return loss_scaled(opt)
    return opt


def describe(cfg: TrainConfig, total_updates: int) -> str:
    """``cfg``'s optimizer in words, for the summary: ``"adamw (lr 0.001, weight decay
    0.0001), warmup-cosine (10 warmup of 500 updates), clipped at global norm 1"``; only
    what applies: an optimizer of your own that takes no learning rate keeps its own
    (``"opt.py:OPT (its own settings)"``, a function: ``"(its own learning rate)"``)."""
    own = None
    if is_optimizer_ref(cfg.optimizer):
        obj = resolve_optimizer(cfg.optimizer)
        if isinstance(obj, optax.GradientTransformation):
            own = "its own settings"
        elif not _takes_learning_rate(obj):
            own = "its own learning rate"
    what = [f"lr {cfg.lr:g}"] if own is None else [own]
    if cfg.optimizer == "adamw":
        wd = 1e-4 if cfg.weight_decay is None else cfg.weight_decay
        what.append(f"weight decay {wd:g}")
    text = f"{cfg.optimizer} ({', '.join(what)})"
    if cfg.lr_schedule != "constant" and own is None:  # (else refused)
        length = cfg.decay_steps if cfg.decay_steps is not None else total_updates
        text += f", {cfg.lr_schedule} ({cfg.warmup_steps} warmup of {length} updates)"
    if cfg.clip_norm is not None:
        text += f", clipped at global norm {cfg.clip_norm:g}"
    if cfg.precision == "f16":
        text += ", dynamic loss scaling (float16)"
    return text


def learning_rate_options(cfg: TrainConfig) -> tuple[str, ...]:
    """The learning-rate settings ``cfg`` gives, with their values (``"learning_rate=0.5"``,
    ``"lr_schedule='warmup-cosine'"``, ...; on the command line ``"--lr 0.5"``, ...:
    :func:`~pdjax.apps.train.wording.setting`): what an optimizer of your own must take
    ``learning_rate`` for."""
    given = [] if cfg.learning_rate is None else [setting("learning_rate", cfg.learning_rate)]
    if cfg.lr_schedule != "constant":
        given.append(setting("lr_schedule", cfg.lr_schedule))
        if cfg.warmup_steps:
            given.append(setting("warmup_steps", cfg.warmup_steps))
        if cfg.decay_steps is not None:
            given.append(setting("decay_steps", cfg.decay_steps))
    return tuple(given)


def resolve_optimizer(ref: str) -> Any:
    """What ``package.module:fn`` (or ``path/to/file.py:fn``) names, imported as
    ``model`` factories are (the current directory first on the path): a function, or
    an :class:`optax.GradientTransformation` itself. Nothing is called.

    Raises:
      PipelineError: one line: the module cannot be imported or has no such attribute.
    """
    check_optimizer_name(ref)
    target, _, attr = ref.rpartition(":")
    obj: Any = _import(target, ref)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PipelineError(
                f"{_named(ref)}: {target} has no attribute {part!r}; give one as {target}:NAME"
            )
        obj = getattr(obj, part)
    return obj


def _refuse_unreachable(ref: str, obj: Any, given: tuple[str, ...]) -> None:
    """Refuses learning-rate settings (``given``) that ``obj``, what ``ref`` names, cannot
    take: an optax object (made with its own settings), or a function without a
    ``learning_rate`` parameter."""
    if not given:
        return
    options = (" " if in_command_line() else ", ").join(given)
    target = ref.rpartition(":")[0]
    if isinstance(obj, optax.GradientTransformation) or not callable(obj):
        raise PipelineError(
            f"{_named(ref)} is an optax.GradientTransformation made with its own "
            f"settings, so {options} cannot reach it: name a function that makes it "
            f"instead, {target}:make with def make(learning_rate): return ..., or drop "
            f"{options}"
        )
    if not _takes_learning_rate(obj):
        raise PipelineError(
            f"{_named(ref)} takes no learning_rate, so {options} cannot reach it: give "
            f"the function a learning_rate parameter, or drop {options}"
        )


def step_settings(cfg: TrainConfig) -> tuple[str, ...]:
    """The settings that size ``cfg``'s optimizer steps, with their values
    (``"learning_rate=0.001"``, ``"weight_decay=1e+06"``, ``"clip_norm=1"``; on the command
    line ``"--lr 0.001"``, ...; for an optimizer of your own that takes no learning rate,
    its own settings): what a divergence may come from."""
    out = []
    if is_optimizer_ref(cfg.optimizer) and not _takes_learning_rate(
        resolve_optimizer(cfg.optimizer)
    ):
        out.append(f"{setting('optimizer', cfg.optimizer)} (its own settings)")
    else:
        out.append(setting("learning_rate", float(cfg.lr)))
    if cfg.optimizer == "adamw":
        decay = 1e-4 if cfg.weight_decay is None else cfg.weight_decay
        out.append(setting("weight_decay", float(decay)))
    if cfg.clip_norm is not None:
        out.append(setting("clip_norm", float(cfg.clip_norm)))
    return tuple(out)


def load_optimizer(
    ref: str, lr: float | optax.Schedule | None = None, *, given: tuple[str, ...] = ()
) -> optax.GradientTransformation:
    """The optimizer ``package.module:fn`` (or ``path/to/file.py:fn``) names
    (:func:`resolve_optimizer`): ``fn()`` called with ``learning_rate=lr`` if it takes it
    (:data:`DEFAULT_LEARNING_RATE` where ``lr`` is None), or an optax object named itself.
    ``fn`` is called once per process for each learning rate (a number, or a schedule
    object: :func:`learning_rate` gives one per setting): every check and run reuses
    what it returned, so its prints and side effects happen once.

    Args:
      ref: ``package.module:fn``.
      lr: the learning rate given (None: none).
      given: the settings that gave ``lr`` (``"learning_rate=0.5"``, ...:
        :func:`learning_rate_options`),
        named where they cannot reach the optimizer.

    Raises:
      PipelineError: one line: the module cannot be imported, has no such attribute, the
        function needs arguments it is not given, fails, or returns something that is not
        an :class:`optax.GradientTransformation`; or ``given`` settings for an optimizer
        that takes no learning rate (an optax object, a function without ``learning_rate``).
    """
    obj = resolve_optimizer(ref)
    _refuse_unreachable(ref, obj, given)
    if not callable(obj) or isinstance(obj, optax.GradientTransformation):
        result = obj
    else:
        takes = _takes_learning_rate(obj)
        rate = DEFAULT_LEARNING_RATE if lr is None else lr
        args = {"learning_rate": rate} if takes else {}
        try:
            inspect.signature(obj).bind(**args)
        except TypeError as e:
            raise PipelineError(
                f"{_named(ref)}: cannot call it: {e}. pdjax calls it with no arguments "
                "but learning_rate (by keyword, if it takes it): give its other parameters "
                "defaults"
            ) from e
        except ValueError:  # no signature to check
            pass
        key = (id(obj), rate if takes else None)
        made = _MADE.get(key)
        if made is not None and made[0] is obj:
            return made[1]
        try:
            result = obj(**args)
        except (KeyboardInterrupt, LaunchInterrupted):
            raise
        except BaseException as e:  # the user's function, as one line
            raise PipelineError(
                f"{_named(ref)}: {ref} failed: {describe_failure(e)}{DEBUG_HINT}"
            ) from e
        if isinstance(result, optax.GradientTransformation):
            while len(_MADE) >= _MADE_MAX:
                _MADE.pop(next(iter(_MADE)))
            _MADE[key] = (obj, result)
    if not isinstance(result, optax.GradientTransformation):
        raise PipelineError(
            f"{_named(ref)} gave a {type(result).__name__}, not an "
            "optax.GradientTransformation: return one, e.g. optax.adam(learning_rate)"
        )
    return result


def _takes_learning_rate(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    p = params.get("learning_rate")
    return p is not None and p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


def _import(target: str, ref: str) -> Any:
    """The module ``target`` names: a dotted module name, or a ``.py`` file; any failure as
    one :class:`PipelineError` naming ``ref``."""
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    try:
        if is_file:
            if not os.path.isfile(target):
                raise PipelineError(f"{_named(ref)}: no file {target!r}")
            name = "_pdjax_optimizer_" + str(abs(hash(os.path.abspath(target))))
            if name in sys.modules:
                return sys.modules[name]
            spec = importlib.util.spec_from_file_location(name, target)
            if spec is None or spec.loader is None:
                raise PipelineError(f"{_named(ref)}: cannot load {target!r} as Python")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
            return module
        cwd = os.getcwd()
        if "" not in sys.path and cwd not in sys.path:
            sys.path.insert(0, cwd)  # as python -m does
        return importlib.import_module(target)
    except (KeyboardInterrupt, LaunchInterrupted, PdjaxError):
        raise
    except ModuleNotFoundError as e:
        raise PipelineError(
            f"{_named(ref)}: cannot import {target!r}: no module {e.name!r} on the path "
            f"(the current directory, {os.getcwd()}, is searched as with python -m); install "
            "it, add its folder to PYTHONPATH, or give the file: path/to/module.py:fn"
        ) from e
    except SyntaxError as e:
        raise PipelineError(f"{_named(ref)}: {e.filename}:{e.lineno}: syntax error: {e.msg}") from e
    except BaseException as e:  # the module's own code failed while importing
        raise PipelineError(
            f"{_named(ref)}: importing {target!r} failed: {describe_failure(e)}{DEBUG_HINT}"
        ) from e


def check_settings(cfg: TrainConfig) -> None:
    """Refuses optimizer settings that do not go together (``TrainConfig`` calls it).

    Raises:
      PipelineError: saying what to change.
    """
    check_optimizer_name(cfg.optimizer)
    if cfg.learning_rate is not None:
        if not (math.isfinite(cfg.learning_rate) and cfg.learning_rate > 0):
            raise PipelineError(f"learning_rate must be > 0, got {cfg.learning_rate}")
        _check_float32("learning_rate", cfg.learning_rate, "every update would be 0")
    if cfg.weight_decay is not None:
        if not (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
            raise PipelineError(f"weight_decay must be >= 0, got {cfg.weight_decay}")
        if cfg.optimizer != "adamw":
            raise PipelineError(
                f"{setting('weight_decay')} is an option of {setting('optimizer', 'adamw')} "
                "(decoupled weight decay), "
                f"not of {cfg.optimizer}: use adamw, or put the decay in your own optimizer"
            )
        if cfg.weight_decay:  # 0: no decay, exactly
            _check_float32("weight_decay", cfg.weight_decay, "the decay would be 0")
    if cfg.clip_norm is not None:
        if not (math.isfinite(cfg.clip_norm) and cfg.clip_norm > 0):
            raise PipelineError(f"clip_norm must be > 0, got {cfg.clip_norm}")
        _check_float32("clip_norm", cfg.clip_norm, "every gradient would be clipped to 0")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise PipelineError(
            f"unknown lr_schedule {cfg.lr_schedule!r}; choose {' or '.join(LR_SCHEDULES)}"
        )
    if cfg.warmup_steps < 0:
        raise PipelineError(f"warmup_steps must be >= 0, got {cfg.warmup_steps}")
    if cfg.decay_steps is not None and cfg.decay_steps < 1:
        raise PipelineError(f"decay_steps must be >= 1, got {cfg.decay_steps}")
    if cfg.lr_schedule == "constant":
        given = (("warmup_steps", cfg.warmup_steps), ("decay_steps", cfg.decay_steps))
        cosine = setting("lr_schedule", "warmup-cosine")
        for name, value in given:
            if value:
                raise PipelineError(
                    f"{setting(name)} is an option of {cosine}; the learning rate is "
                    f"constant: add {cosine}, or drop it"
                )
    elif cfg.decay_steps is not None and cfg.decay_steps <= cfg.warmup_steps:
        raise PipelineError(
            f"{setting('decay_steps', cfg.decay_steps)} counts the whole schedule, warmup "
            f"included: it must be more than {setting('warmup_steps', cfg.warmup_steps)}"
        )


def _check_float32(name: str, value: float, zero: str) -> None:
    """Refuses a positive setting that float32, the parameters' dtype and the optimizer's
    (in every precision), cannot hold as a normal number: below its smallest, about
    1.2e-38, it is subnormal (which XLA flushes to 0) or 0 itself (``zero`` says what
    follows); above its largest, about 3.4e38, it is infinite. ``name``: the setting's
    keyword (:func:`~pdjax.apps.train.wording.setting`)."""
    given = f"{setting(name)} {value!r}" if in_command_line() else f"{name}={value!r}"
    tiny, huge = float(_FLOAT32.tiny), float(_FLOAT32.max)
    if value < tiny:
        held = float(np.float32(value))
        as_f32 = "0" if held == 0 else f"the subnormal {held:g}, which XLA flushes to 0"
        raise PipelineError(
            f"{given} is below float32's smallest normal number ({tiny:.3g}): the "
            f"parameters and the optimizer compute in float32, where it is {as_f32}, so "
            f"{zero}; give {setting(name, float(f'{tiny:.3g}'))} or more"
        )
    if value > huge:
        raise PipelineError(
            f"{given} is above float32's largest number ({huge:.3g}): the parameters and "
            "the optimizer compute in float32, where it is infinite; give "
            f"{setting(name, float(f'{huge:.3g}'))} or less"
        )


def run_updates(cfg: TrainConfig, num_train: int) -> int:
    """The optimizer updates (stage 0's) a run of ``cfg`` makes in ``cfg.epochs`` epochs
    of ``num_train`` samples: one per step of ``batch_size`` samples, or per microbatch
    for a schedule that updates per microbatch (``pipedream``; a round-robin stage 0
    makes fewer, once per group). At least 1."""
    from pdjax.apps.train.config import updates_per_microbatch
    from pdjax.apps.train.planning import epoch_microbatches

    microbatches = epoch_microbatches(cfg, num_train)
    per_step = 1 if updates_per_microbatch(cfg.schedule) else cfg.step_microbatches
    per_epoch = microbatches // per_step
    return max(1, per_epoch * cfg.epochs)
