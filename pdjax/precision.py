"""Mixed precision: the dtypes a model keeps its parameters in, computes in, and outputs.

A policy is DeepMind's ``jmp.Policy`` (``param_dtype``, ``compute_dtype``,
``output_dtype``); :func:`get_policy` reads one from a string. Give it to
:func:`pdjax.sequential` (``precision=``) and every layer computes in the compute dtype:

* the optimizer's parameters stay in the parameter dtype (float32); each layer casts its
  float parameters and float inputs to the compute dtype inside its ``apply``, so the
  gradients come back in the parameter dtype through the cast;
* each layer's output is in the compute dtype, so activations (and their gradients) cross
  pipeline stages in it: half the bytes of float32 in bfloat16;
* the last layer's output is cast to the output dtype (float32) before the loss;
* integer and PRNG-key leaves (token ids, keys) are never cast, and non-parameter
  collections (BatchNorm statistics) stay in their own dtype.

The profiler calls the same ``apply``, so it costs the model in the compute dtype.

float16 compute needs loss scaling (the last stage scales the loss's cotangent, every
stage unscales its gradients and, for dynamic scaling, all stages skip an update together
when any stage's gradients are not finite), which the pipeline runtime does not do yet:
policies with float16 are refused; bfloat16 has float32's range and needs none.

>>> p = get_policy("bf16")
>>> str(p)
'p=full,c=bf16,o=full'
>>> get_policy("params=float32,compute=bfloat16,output=float32") == p
True
"""

from __future__ import annotations

from typing import TypeAlias

import jax.numpy as jnp
import jmp
import numpy as np

from pdjax.errors import LayerError

__all__ = ["Policy", "get_policy"]

#: A mixed precision policy: ``jmp.Policy(param_dtype, compute_dtype, output_dtype)``.
Policy: TypeAlias = jmp.Policy  # Any to mypy: jmp ships no type information

_FORMS = (
    "write 'bf16' (parameters and output float32, compute bfloat16) or "
    "'params=float32,compute=bfloat16,output=float32' (keys p, c, o; dtypes float32 or f32, "
    "bfloat16 or bf16)"
)


def get_policy(spec: Policy | str) -> Policy:
    """A checked mixed precision policy from a ``jmp.Policy`` or a string.

    A bare dtype name is the compute dtype of the usual mixed policy: ``"bf16"`` and
    ``"bfloat16"`` mean parameters float32, compute bfloat16, output float32 (unlike
    ``jmp.get_policy("bf16")``, which puts all three in bfloat16; write
    ``"params=bf16,compute=bf16,output=bf16"`` for that). ``"float32"`` (``"f32"``,
    ``"full"``) changes nothing. Any other string is parsed by ``jmp.get_policy``:
    ``"params=float32,compute=bfloat16,output=float32"`` (keys ``p``, ``c``, ``o`` for
    short; compute defaults to the params dtype, output to the compute dtype).

    Raises:
      LayerError: for a string neither form reads, a policy with a dtype that is not a
        float, or float16 anywhere in the policy (it needs loss scaling, which pdjax's
        pipeline does not do yet; use bfloat16).

    >>> get_policy("c=bf16").output_dtype is jnp.bfloat16
    True
    >>> get_policy("bfloat17")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pdjax.errors.LayerError: precision 'bfloat17' is not a policy (Unknown dtype 'bfloat17' ...
    """
    if isinstance(spec, str):
        text = spec.strip().lower()
        try:
            if "=" in text:
                policy = jmp.get_policy(text.replace(" ", ""))
            else:
                compute = jmp.get_policy(text).compute_dtype  # jmp's dtype names
                policy = Policy(jnp.float32, compute, jnp.float32)
        except (ValueError, KeyError) as e:
            raise LayerError(f"precision {spec!r} is not a policy ({e}); {_FORMS}") from None
    elif isinstance(spec, jmp.Policy):
        policy = spec
    else:
        raise LayerError(
            f"precision must be a jmp.Policy or a string, got {type(spec).__name__}; {_FORMS}"
        )
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
        dtype = np.dtype(getattr(policy, field))
        if not jnp.issubdtype(dtype, jnp.floating):
            raise LayerError(f"precision {spec!r}: {field} is {dtype}, not a float dtype")
        if dtype == np.dtype(jnp.float16):
            raise LayerError(
                f"precision {spec!r}: float16 needs loss scaling (scale the loss, unscale "
                "the gradients, skip an update whose gradients overflow, on every stage "
                "together), which pdjax's pipeline does not do yet; use bfloat16 "
                "(precision='bf16'), which has float32's range and needs none"
            )
    return policy
