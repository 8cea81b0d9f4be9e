"""Variable-length microbatches on in-process CPU devices: a stream of sequence-length
buckets against padding every example to the longest bucket, side by side.

One pipeline (Llama tiny, its context raised to the longest bucket, ``1f1b`` on 2 or 4
stages, one CPU device per stage) trains one epoch of the same examples two ways:

* **bucketed**: each example padded to the smallest bucket that holds it
  (:func:`pdjax.apps.data.bpe.bucket_examples`), batches of one bucket each
  (:meth:`Buckets.batches`), one ``Pipeline.step`` per batch;
* **padded**: every example padded to the longest bucket, the same batch size.

It reports the examples per bucket, the programs XLA compiled at the first call of each
bucket and during the timed epochs (counted by ``jax.monitoring``'s compile events, which
JAX fires once per backend compilation), and the throughput in **real** tokens per second
(targets that are not padding), the two runs' epochs interleaved ``--rounds`` times (the
machine's noise hits both alike), with the median ratio.

Data (``--data``): ``synthetic`` (default) draws document lengths from a log-normal
distribution (median ``--median`` tokens, ``--sigma``; random token ids: throughput does
not depend on them); ``pydoc`` is the bundled corpus of
:func:`pdjax.apps.data.bpe.text_bpe_buckets` (CPython's documentation, byte-level BPE,
needs ``tokenizers``), whose documents are long: most pieces fill the longest bucket.

    python benchmarks/bench_buckets.py [--stages 2] [--buckets 32,64,128,256] [--batch 16]
        [--microbatches 4] [--rounds 3] [--data synthetic|pydoc] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)

import jax.monitoring  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from pdjax.apps.data.bpe import (  # noqa: E402
    IGNORE,
    Buckets,
    bucket_examples,
    document_examples,
    text_bpe_buckets,
)
from pdjax.models import get_model  # noqa: E402
from pdjax.partition import StagePlan  # noqa: E402
from pdjax.pipeline import Pipeline  # noqa: E402
from pdjax.schedules import ScheduleSpec  # noqa: E402

_compiled: collections.Counter[str] = collections.Counter()


def _count(event: str, duration: float, **kw: object) -> None:
    if event.endswith("backend_compile_duration"):
        _compiled[str(kw.get("fun_name"))] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def compiles() -> int:
    """Backend compilations so far in this process."""
    return sum(_compiled.values())


def masked_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross-entropy over the real targets (padding weighs zero)."""
    real = (targets != IGNORE).astype(jnp.float32)
    token = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
    return jnp.sum(token * real) / jnp.maximum(jnp.sum(real), 1.0)


def synthetic_examples(
    n_docs: int, vocab: int, median: float, sigma: float, max_len: int, seed: int
) -> list[np.ndarray]:
    """Documents of log-normal lengths (random ids >= 2: 0 and 1 are EOT and PAD), framed
    and cut at ``max_len`` positions as :func:`document_examples` does."""
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.round(rng.lognormal(np.log(median), sigma, n_docs)), 1, 20 * max_len)
    docs = [rng.integers(2, vocab, int(n)).astype(np.int32) for n in sizes]
    return document_examples(docs, 0, max_len)


def pydoc_examples(lengths: tuple[int, ...], vocab: int) -> list[np.ndarray]:
    """The bundled corpus's training examples (re-made from its buckets: each row's
    tokens up to its last real target)."""
    train, _, _ = text_bpe_buckets(lengths, vocab_size=vocab)
    out = []
    for b in train.buckets:
        for x, y in zip(b.inputs, b.targets, strict=True):
            n = int((y != IGNORE).sum())
            out.append(np.concatenate([x[:n], y[n - 1 : n]]).astype(np.int32))
    return out


def epoch(pipe: Pipeline, state, batches):  # type: ignore[no-untyped-def]
    """One pass over ``batches``: the state, real tokens, seconds, and per call the
    sequence length and the compilations it caused."""
    t0 = time.perf_counter()
    tokens, calls = 0, []
    for x, y in batches:
        before = compiles()
        state, metrics = pipe.step(state, (x, y))
        jax.block_until_ready(metrics.losses)
        calls.append((x.shape[1], compiles() - before))
        tokens += int((y != IGNORE).sum())
    jax.block_until_ready(jax.tree.leaves(state.params))
    return state, tokens, time.perf_counter() - t0, calls


def main() -> None:
    """Runs the benchmark (see the module) and prints its table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2, choices=(2, 4))
    ap.add_argument("--buckets", default="32,64,128,256")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", choices=("synthetic", "pydoc"), default="synthetic")
    ap.add_argument("--docs", type=int, default=600, help="synthetic documents")
    ap.add_argument("--median", type=float, default=48.0, help="synthetic median length")
    ap.add_argument("--sigma", type=float, default=0.9, help="synthetic log-normal sigma")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args()
    lengths = tuple(int(n) for n in args.buckets.split(","))
    longest = lengths[-1]
    if args.data == "synthetic":
        examples = synthetic_examples(
            args.docs, args.vocab, args.median, args.sigma, longest, args.seed
        )
    else:
        examples = pydoc_examples(lengths, args.vocab)
    bucketed: Buckets = bucket_examples(examples, lengths, pad_id=1)
    padded: Buckets = bucket_examples(examples, (longest,), pad_id=1)

    spec = get_model(
        "llama", "tiny", context=longest, seq_len=longest, vocab_size=args.vocab, dropout=0.0
    )
    P = args.stages
    bounds = {2: [(0, 1), (2, 3)], 4: [(0, 0), (1, 1), (2, 2), (3, 3)]}[P]
    plan = [StagePlan(a, b, (s,)) for s, (a, b) in enumerate(bounds)]
    pipe = Pipeline(
        spec.layers,
        plan,
        masked_loss,
        optax.adam(1e-3),
        schedule=ScheduleSpec("1f1b", microbatches=args.microbatches),
    )
    rows = args.batch // args.microbatches
    state = pipe.init(jax.random.key(args.seed), np.zeros((rows, longest), np.int32))

    # warm-up: the first epoch of each way compiles its programs; count them per bucket
    first: dict[int, int] = {}
    again: dict[int, int] = collections.defaultdict(int)
    for way in (bucketed, padded):
        state, _, _, calls = epoch(pipe, state, way.batches(args.batch, seed=args.seed, epoch=0))
        for n, c in calls:
            if n not in first:
                first[n] = c
            else:
                again[n] += c

    rates: dict[str, list[float]] = {"bucketed": [], "padded": []}
    timed_compiles = 0
    tokens_of = {}
    for r in range(args.rounds):
        for name, way in (("bucketed", bucketed), ("padded", padded)):
            state, tokens, seconds, calls = epoch(
                pipe, state, way.batches(args.batch, seed=args.seed, epoch=1 + r)
            )
            timed_compiles += sum(c for _, c in calls)
            rates[name].append(tokens / seconds)
            tokens_of[name] = (tokens, len(calls))
    ratios = [b / p for b, p in zip(rates["bucketed"], rates["padded"], strict=True)]

    print(
        f"llama tiny (context {longest}, vocab {args.vocab}), 1f1b on {P} CPU stages, "
        f"batch {args.batch} = {args.microbatches} microbatches, data {args.data}"
    )
    print(
        f"{'bucket':>7} {'examples':>9} {'real tok':>9} {'padding':>8} "
        f"{'compiled (1st call)':>20} {'compiled after':>15}"
    )
    for b in bucketed.buckets:
        pad = 1 - b.real_tokens / b.targets.size if b.targets.size else 0.0
        print(
            f"{b.length:>7} {len(b.inputs):>9} {b.real_tokens:>9} {pad:>8.1%} "
            f"{first.get(b.length, 0):>20} {again.get(b.length, 0):>15}"
        )
    print(
        f"padding: bucketed {bucketed.padding_fraction:.1%}, "
        f"all at {longest}: {padded.padding_fraction:.1%}"
    )
    print(f"compilations during the {args.rounds} timed rounds (both ways): {timed_compiles}")
    for name in rates:
        tokens, calls = tokens_of[name]
        print(
            f"{name:>9}: {calls} calls, {tokens} real tokens per epoch, real tokens/s "
            f"median {statistics.median(rates[name]):,.0f} "
            f"({', '.join(f'{v:,.0f}' for v in rates[name])})"
        )
    print(
        f"ratio bucketed / padded (real tokens/s): median {statistics.median(ratios):.2f} "
        f"({', '.join(f'{v:.2f}' for v in ratios)})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "buckets": [
                        {
                            "length": b.length,
                            "examples": len(b.inputs),
                            "real_tokens": b.real_tokens,
                            "compiled_first_call": first.get(b.length, 0),
                            "compiled_after": again.get(b.length, 0),
                        }
                        for b in bucketed.buckets
                    ],
                    "timed_compiles": timed_compiles,
                    "rates": rates,
                    "ratios": ratios,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
