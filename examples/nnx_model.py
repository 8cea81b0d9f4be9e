"""Your own Flax NNX model through a pdjax pipeline, and back.

A small GPT-style transformer written the way Flax's examples write one (dropout whose
``__call__`` takes ``deterministic``, an output head that reuses the token embedding with
``embed.attend``) learns a toy language: sequences that count up modulo the vocabulary,
from a random start. It trains with the ``1f1b`` schedule on 4 CPU devices (3 stages, the
middle one replicated on 2 devices), reports loss and accuracy per step from the loss
function's aux output, evaluates through the pipeline, and finally puts the trained
weights back into the very model object it started from.

    python examples/nnx_model.py           # about a minute on 2 CPU cores
    python examples/nnx_model.py --tiny    # 2 steps of a 1-block model (what the tests run)
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)  # before any device is used

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import pdjax  # noqa: E402
from pdjax.partition import StagePlan  # noqa: E402

VOCAB, WIDTH, TOKENS, HEADS = 16, 32, 12, 4


class Embedding(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.tok = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.pos = nnx.Embed(TOKENS, WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, ids, *, deterministic: bool = False):
        x = self.tok(ids) + self.pos(jnp.arange(ids.shape[1]))[None]
        return self.dropout(x, deterministic=deterministic)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=WIDTH, decode=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, *, deterministic: bool = False):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.dropout(self.attn(self.ln1(x), mask=mask), deterministic=deterministic)
        h = self.down(nnx.gelu(self.up(self.ln2(x))))
        return x + self.dropout(h, deterministic=deterministic)


class Head(nnx.Module):
    def __init__(self, embed: nnx.Embed, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.embed = embed  # the token embedding itself: input and output weights tied

    def __call__(self, x):
        return self.embed.attend(self.ln(x))


class GPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, depth: int = 2):
        self.embedding = Embedding(rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(depth)])
        self.head = Head(self.embedding.tok, rngs)

    def __call__(self, ids, *, deterministic: bool = False):
        x = self.embedding(ids, deterministic=deterministic)
        for block in self.blocks:
            x = block(x, deterministic=deterministic)
        return self.head(x)


def loss_fn(logits, targets):
    """Mean cross-entropy, with accuracy as an aux metric."""
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, {"accuracy": (logits.argmax(-1) == targets).mean()}


def batches(n: int, size: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Counting sequences mod VOCAB from random starts: inputs and next-token targets."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seq = (rng.integers(0, VOCAB, (size, 1)) + np.arange(TOKENS + 1)) % VOCAB
        out.append((seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)))
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a few steps (tests)")
    args = parser.parse_args(argv)
    steps = 2 if args.tiny else 150
    depth = 1 if args.tiny else 2

    model = GPT(nnx.Rngs(0), depth)
    layers = pdjax.sequential(
        model.embedding,
        *model.blocks,
        model.head,
        names=["embedding", *(f"block{i}" for i in range(depth)), "head"],
        # the head's embedding is the token embedding: one parameter, declared
        tied={"wte": ["embedding/tok/embedding", "head/embed/embedding"]},
    )
    if args.tiny:  # 2 stages: fewer programs to compile
        plan = [StagePlan(0, 1, (0,)), StagePlan(2, 2, (1,))]
    else:  # 3 stages, the blocks' stage replicated on 2 devices
        plan = [StagePlan(0, 0, (0,)), StagePlan(1, 2, (1, 2)), StagePlan(3, 3, (3,))]
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))
    pipe = pdjax.Pipeline(
        layers, plan, loss_fn, optimizer, schedule=pdjax.ScheduleSpec("1f1b", microbatches=4)
    )
    train, test = batches(steps, 32, seed=0), batches(4, 32, seed=1)
    state = pipe.init(jax.random.key(0), train[0][0][:8])

    t0 = time.perf_counter()
    for step, batch in enumerate(train, 1):
        state, metrics = pipe.step(state, batch)
        if step % max(1, steps // 5) == 0 or step == steps:
            acc = metrics.mean_aux()["accuracy"]
            print(f"step {step:4d}  loss {metrics.loss:.3f}  accuracy {acc:.3f}")
    print(f"trained {steps} steps in {time.perf_counter() - t0:.1f} s")

    result = pipe.evaluate(state, test)  # forward only, through the stages
    print(f"test: loss {result['loss']:.3f}  accuracy {result['accuracy']:.3f}")

    pipe.update_nnx(state, model)  # the trained weights, in your own model object
    x, y = test[0]
    own_loss, _ = nnx.jit(lambda m, x, y: loss_fn(m(x, deterministic=True), y))(
        model, jnp.asarray(x), jnp.asarray(y)
    )
    piped = pipe.evaluate(state, [test[0]])["loss"]
    print(f"first test batch: your model {float(own_loss):.4f}, the pipeline {piped:.4f}")
    return {"loss": result["loss"], "accuracy": result["accuracy"]}


if __name__ == "__main__":
    main()
