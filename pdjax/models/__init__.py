"""The paper's model families as layer sequences, each with a tiny and a paper config.

``get_model(name, config)`` returns a :class:`ModelSpec`: the model as a
:class:`~pdjax.layers.LayerSequence` of ``flax.linen`` modules (what pdjax profiles,
partitions and runs), the same model as one ordinary linen module (``monolith``, whose
top-level submodules are named as the layers), a sampler of synthetic batches, and the
loss (mean softmax cross-entropy over integer labels).

============  ==============  ==========================================  ============
name          task            paper config                                layers
============  ==============  ==========================================  ============
``mlp``       classification  demo: 784 -> 3 x 1024 -> 10                 4 (tiny 4)
``cnn``       classification  demo: 28x28x1, 3 conv, dense                5 (tiny 5)
``vgg16``     classification  VGG-16, ImageNet, 138.4M params             21 (tiny 21)
``alexnet``   classification  AlexNet, ImageNet, 61.1M params             8 (tiny 8)
``resnet50``  classification  ResNet-50, ImageNet, 25.6M params           18 (tiny 6)
``gnmt``      seq2seq         GNMT-8, hidden 1024, vocabulary 32000       10 (tiny 10)
``awd_lm``    language_model  AWD-LSTM, WikiText-2, vocabulary 33278      5 (tiny 5)
``gpt``       language_model  GPT-2 small (untied head), context 1024     14 (tiny 4)
``llama``     language_model  Llama-style (nnx), GQA, 336.1M params       26 (tiny 4)
============  ==============  ==========================================  ============

>>> import jax
>>> spec = get_model("mlp")
>>> x, y = spec.sample_batch(4)
>>> variables = spec.layers.init(jax.random.key(0), x)
>>> logits, _ = spec.layers.apply(variables, x)
>>> logits.shape
(4, 10)
>>> bool(spec.loss(logits, y) > 0)
True

A model of your own comes from a factory: ``get_model("package.module:factory")`` (and
``--model package.module:factory`` on the command line) imports the module, calls the
factory and takes what it returns: a :class:`ModelSpec`, or a :class:`CustomModel` (a
dict, NamedTuple or object with its fields: ``layers``, ``loss``, ``sample_batch``,
optionally ``accuracy``). See :func:`load_model`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pdjax.errors import LaunchInterrupted, LayerError
from pdjax.models import alexnet, awd_lm, cnn, gnmt, gpt, llama, mlp, resnet, vgg
from pdjax.models.alexnet import AlexNetConfig
from pdjax.models.awd_lm import AWDLMConfig
from pdjax.models.cnn import CNNConfig
from pdjax.models.gnmt import GNMTConfig
from pdjax.models.gpt import GPTConfig
from pdjax.models.llama import LlamaConfig
from pdjax.models.mlp import MLPConfig
from pdjax.models.resnet import ResNetConfig
from pdjax.models.spec import (
    DEBUG_HINT,
    CustomModel,
    ModelSpec,
    Sampler,
    Task,
    as_model_spec,
    describe_failure,
)
from pdjax.models.vgg import VGGConfig

__all__ = [
    "CONFIGS",
    "EXTRA_CONFIGS",
    "MODELS",
    "AWDLMConfig",
    "AlexNetConfig",
    "CNNConfig",
    "CustomModel",
    "GNMTConfig",
    "GPTConfig",
    "LlamaConfig",
    "MLPConfig",
    "ModelSpec",
    "ResNetConfig",
    "Sampler",
    "Task",
    "VGGConfig",
    "as_model_spec",
    "check_model_name",
    "get_model",
    "is_model_ref",
    "load_model",
]

_FAMILIES: dict[str, tuple[type, Callable[[Any, str], ModelSpec]]] = {
    "mlp": (MLPConfig, mlp.make_spec),
    "cnn": (CNNConfig, cnn.make_spec),
    "vgg16": (VGGConfig, vgg.make_spec),
    "alexnet": (AlexNetConfig, alexnet.make_spec),
    "resnet50": (ResNetConfig, resnet.make_spec),
    "gnmt": (GNMTConfig, gnmt.make_spec),
    "awd_lm": (AWDLMConfig, awd_lm.make_spec),
    "gpt": (GPTConfig, gpt.make_spec),
    "llama": (LlamaConfig, llama.make_spec),
}

#: Registry names accepted by :func:`get_model` (``"awd-lm"`` is accepted too).
MODELS: tuple[str, ...] = tuple(_FAMILIES)
#: Configuration names accepted by :func:`get_model` for every family.
CONFIGS: tuple[str, ...] = ("tiny", "paper")
#: Configurations some families have besides :data:`CONFIGS`.
EXTRA_CONFIGS: dict[str, tuple[str, ...]] = {"llama": ("small", "7b")}
#: Config names that are not a method name of the family's config class: the method.
_CONFIG_METHODS = {"7b": "llama2_7b"}


def is_model_ref(name: str) -> bool:
    """Whether ``name`` names a model factory, ``package.module:factory`` (or
    ``path/to/file.py:factory``), rather than a bundled model."""
    return ":" in name


def _unknown_model(name: str) -> str:
    hint = ""
    if "." in name or "/" in name or os.sep in name:
        hint = f" (a factory needs its name after a colon: '{name}:build' calls build())"
    return (
        f"unknown model {name!r}{hint}; give a bundled model, one of {', '.join(MODELS)}, or "
        "your own as package.module:factory, a function returning a pdjax.models.ModelSpec "
        "or CustomModel(layers=..., loss=..., sample_batch=(x, y)), imported with the "
        "current directory on the path"
    )


def check_model_name(name: str) -> None:
    """Checks the form of a model name without importing anything: a bundled name or a
    ``package.module:factory`` reference.

    Raises:
      LayerError: naming the bundled models and the factory form.
    """
    if is_model_ref(name):
        module, _, attr = name.rpartition(":")
        if not module or not attr:
            raise LayerError(
                f"--model {name!r}: a model factory is written package.module:factory (or "
                "path/to/file.py:factory), with both parts"
            )
        return
    if name.strip().lower().replace("-", "_") not in _FAMILIES:
        raise LayerError(_unknown_model(name))


def get_model(name: str, config: str = "tiny", **overrides: Any) -> ModelSpec:
    """Builds a model family at a named configuration, or a model of your own.

    Args:
      name: one of :data:`MODELS`; case and ``-``/``_`` are ignored (``"awd-lm"`` works).
        Or ``package.module:factory``: :func:`load_model` (``config`` is passed to the
        factory if it takes it, ``overrides`` always).
      config: ``"tiny"`` (for tests: runs in well under a second on a CPU) or
        ``"paper"`` (the size the PipeDream paper trains); some families have more
        (:data:`EXTRA_CONFIGS`: ``llama`` has ``"small"`` and ``"7b"``, Llama-2-7B's
        shapes, for planning from shapes).
      **overrides: fields of the family's config dataclass to replace, e.g.
        ``get_model("gpt", num_layers=4, dropout=0.0)``.

    Returns:
      The :class:`ModelSpec`; ``spec.config`` is ``config`` and ``spec.model_config``
      the config dataclass with the overrides applied.

    Raises:
      LayerError: for an unknown name, config or override field, or an invalid value;
        for a factory, see :func:`load_model`.
    """
    if is_model_ref(name):
        return load_model(name, offer={"config": config}, **overrides)
    key = name.strip().lower().replace("-", "_")
    if key not in _FAMILIES:
        raise LayerError(_unknown_model(name))
    configs = CONFIGS + EXTRA_CONFIGS.get(key, ())
    if config not in configs:
        raise LayerError(f"unknown config {config!r} for {key!r}; choose one of {configs}")
    config_cls, make_spec = _FAMILIES[key]
    model_config = getattr(config_cls, _CONFIG_METHODS.get(config, config))()
    if overrides:
        fields = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise LayerError(
                f"{config_cls.__name__} has no field(s) {unknown}; valid overrides: "
                f"{sorted(fields)}"
            )
        model_config = dataclasses.replace(model_config, **overrides)
    return make_spec(model_config, config)


def load_model(ref: str, *, offer: Mapping[str, Any] | None = None, **kwargs: Any) -> ModelSpec:
    """Imports a model factory and returns its model as a :class:`ModelSpec`.

    ``ref`` is ``package.module:factory``: the module is imported as ``python -m`` would
    (the current directory first on ``sys.path``), and ``factory`` (a dotted path works:
    ``module:Class.method``) is called. ``path/to/file.py:factory`` loads a file instead.
    The factory returns a :class:`ModelSpec` or a :class:`CustomModel`-like value (see
    :func:`~pdjax.models.spec.as_model_spec`); an attribute that is not callable is
    taken as the model itself.

    Args:
      ref: where the factory is.
      offer: keyword arguments the factory gets if it takes them (by name, or through
        ``**kwargs``); the command line offers ``config`` (``--config``) and, for
        ``pdjax train``, ``seq_len`` (``--seq-len``).
      **kwargs: keyword arguments the factory must take.

    Returns:
      The spec; a custom model is named ``ref`` unless it names itself, and its config is
      ``offer["config"]`` (or ``"custom"``).

    Raises:
      LayerError: the module cannot be imported (not on the path, or it fails while
        importing: the message has the error and where), has no such attribute, the
        factory needs arguments it is not given, or it returns something that is not a
        model (the message says what a model is).
    """
    check_model_name(ref)
    target, _, attr = ref.rpartition(":")
    module = _import(target, ref)
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = target if i == 0 else f"{target}:{'.'.join(attr.split('.')[:i])}"
            raise LayerError(
                f"--model {ref!r}: {owner} has no attribute {part!r}"
                + (f"; it defines {', '.join(_public_callables(module))}" if i == 0 else "")
                + f"; give one as {target}:NAME"
            )
        obj = getattr(obj, part)
    offer = dict(offer or {})
    config = str(offer.get("config") or "custom")
    if callable(obj) and not isinstance(obj, ModelSpec):
        args = _factory_arguments(obj, ref, offer, kwargs)
        try:
            result = obj(**args)
        except (KeyboardInterrupt, LaunchInterrupted):
            raise
        except BaseException as e:  # sys.exit() too: the factory's failure, as one line
            raise LayerError(
                f"--model {ref!r}: the factory {ref} failed: {describe_failure(e)}{_where(e)}"
                f"{DEBUG_HINT}"
            ) from e
        what = f"what {ref}() returned"
        where = f"what {ref}() returned"
    else:
        if kwargs:
            raise LayerError(f"--model {ref!r} is a model, not a factory: it takes no {kwargs}")
        result, what, where = obj, f"--model {ref!r}", f"--model {ref!r}"
    if result is None:
        raise LayerError(f"{what} is None; the factory must return the model, {_spec_form()}")
    return as_model_spec(result, name=ref, config=config, where=where)


def _spec_form() -> str:
    return (
        "a pdjax.models.ModelSpec or a pdjax.models.CustomModel(layers=pdjax.sequential(...), "
        "loss=loss_fn, sample_batch=(x, y))"
    )


def _import(target: str, ref: str) -> Any:
    """The module ``target`` names: a dotted module name, or a ``.py`` file. Whatever its
    code raises while importing (``sys.exit()`` too) becomes a :class:`LayerError` naming
    ``ref``; KeyboardInterrupt (and a launcher's signal) goes on."""
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    module, loader = _file_module(target, ref) if is_file else (None, None)
    try:
        if module is not None:
            return module if loader is None else _run_module(module, loader)
        cwd = os.getcwd()
        if "" not in sys.path and cwd not in sys.path:
            sys.path.insert(0, cwd)  # as python -m does
        return importlib.import_module(target)
    except (KeyboardInterrupt, LaunchInterrupted):
        raise
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if not is_file and (target == missing or target.startswith(missing + ".")):
            raise LayerError(
                f"--model {ref!r}: cannot import {target!r}: no module {missing!r} on the path. "
                f"Run pdjax from the folder that holds it (the current directory, "
                f"{os.getcwd()}, is searched as with python -m), add that folder to "
                "PYTHONPATH, install the package, or give the file: path/to/module.py:factory"
            ) from e
        raise LayerError(
            f"--model {ref!r}: importing {target!r} failed: {e} (a module it imports is "
            f"missing{_where(e)}); install it"
        ) from e
    except SyntaxError as e:
        raise LayerError(f"--model {ref!r}: {e.filename}:{e.lineno}: syntax error: {e.msg}") from e
    except BaseException as e:  # the module's own code failed (or exited) while importing
        raise LayerError(
            f"--model {ref!r}: importing {target!r} failed: {describe_failure(e)}{_where(e)}"
            f"{DEBUG_HINT}"
        ) from e


def _file_module(target: str, ref: str) -> tuple[Any, Any]:
    """The module the file ``target`` is: ``(module, None)`` if it is imported already,
    else ``(module, loader)``, the module made but its code not run yet (``loader``'s
    ``exec_module`` runs it)."""
    path = Path(target)
    if not path.is_file():
        raise LayerError(f"--model {ref!r}: no such file {str(path)!r}")
    path = path.resolve()
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded, None
    if loaded is not None:  # another module has that name: keep it, use a private one
        name = f"_pdjax_model_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LayerError(f"--model {ref!r}: cannot load {str(path)!r} as a Python module")
    return importlib.util.module_from_spec(spec), spec.loader


def _run_module(module: Any, loader: Any) -> Any:
    """Runs ``module``'s code (registered in ``sys.modules`` meanwhile, as dataclasses
    and Flax modules look their module up; removed again if it fails)."""
    sys.modules[module.__name__] = module
    try:
        loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module.__name__, None)
        raise
    return module


def _where(e: BaseException) -> str:
    """`` at file:line`` of the innermost frame of ``e``'s traceback, if any."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "importlib" not in f.filename]
    if not frames:
        return ""
    return f", at {frames[-1].filename}:{frames[-1].lineno}"


def _public_callables(module: Any) -> list[str]:
    """The public functions and classes ``module`` defines itself (for error messages)."""
    names = [
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and callable(v)
        and getattr(v, "__module__", None) == module.__name__
    ]
    return sorted(names)[:12] or ["no public functions"]


def _factory_arguments(
    factory: Callable[..., Any], ref: str, offer: Mapping[str, Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The keyword arguments to call ``factory`` with: ``kwargs``, and what it takes of
    ``offer``; checked against its signature."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature: call it with what it must take
        return dict(kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        taken = dict(offer)
    else:
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        taken = {k: v for k, v in offer.items() if k in params and params[k].kind in keyword}
    args = {**taken, **kwargs}
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as e:
        required = [
            n
            for n, p in params.items()
            if p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            and n not in args
        ]
        detail = f"it needs {required}, which pdjax cannot give" if required else str(e)
        raise LayerError(
            f"--model {ref!r}: cannot call the factory: {detail}. pdjax calls it with no "
            f"arguments, passing {', '.join(sorted(offer)) or 'nothing'} by keyword if it takes "
            "them: give its other parameters defaults"
        ) from e
    return args
