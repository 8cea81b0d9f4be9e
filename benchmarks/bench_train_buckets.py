"""``pdjax train --buckets`` on the bundled corpus: padding and real tokens per second
against one length, side by side.

Three runs of ``pdjax.apps.train.train`` on the text-bpe corpus (CPython's documentation,
byte-level BPE of ``--vocab`` tokens), Llama ``--config`` under ``1f1b`` on ``--devices``
CPU devices (an even plan), ``--epoch-steps`` steps of ``--batch-size`` per epoch:

* **buckets**: whole documents, each padded to the smallest of ``--buckets`` that holds it
  (longer ones cut at the largest), every batch from one bucket;
* **one length**: the same documents, every one padded to the largest bucket
  (``buckets`` of that length alone): the padding buckets save;
* **packed**: the corpus packed into windows of the largest bucket's length (no padding,
  documents run into each other: ``text-bpe`` without buckets).

Per run: the share of the training positions that are padding (the data's, before any
step) and the **real** (unpadded) target tokens per second of the epochs after the first
(median), the runs' epochs interleaved ``--rounds`` times in one process.

    python benchmarks/bench_train_buckets.py [--buckets 64,128,256] [--rounds 3]
        [--epoch-steps 10] [--out benchmarks/results/train-buckets.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 4)

from pdjax.apps.train import TrainConfig, build, train  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--buckets", default="64,128,256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--epoch-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--config", default="small")
    p.add_argument("--out", type=Path, default=HERE / "results" / "train-buckets.md")
    args = p.parse_args()
    os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="pdjax-bench-cache-"))
    largest = args.buckets.split(",")[-1]
    common = dict(
        model="llama",
        config=args.config,
        dataset="text-bpe",
        vocab_size=args.vocab,
        schedule="1f1b",
        devices=args.devices,
        plan="even",
        epochs=args.epochs,
        epoch_steps=args.epoch_steps,
        batch_size=args.batch_size,
        microbatches=args.microbatches,
        seq_len=int(largest),
    )
    runs = {
        f"buckets {args.buckets}": TrainConfig(**common, buckets=args.buckets),
        f"one length ({largest}, documents apart)": TrainConfig(**common, buckets=largest),
        f"packed windows of {largest}": TrainConfig(**common),
    }
    built = {label: build(cfg) for label, cfg in runs.items()}
    padding = {}
    for label, (_, ds) in built.items():
        info = ds.info.get("padding")
        padding[label] = info["bucketed"] if info is not None else 0.0
    rates: dict[str, list[float]] = {label: [] for label in runs}
    for r in range(args.rounds):
        for label, cfg in runs.items():
            result = train(cfg, built=built[label])
            got = [rec.tokens_per_second for rec in result.history[1:]]
            rates[label].append(statistics.median(got))
            print(f"round {r + 1} {label}: {rates[label][-1]:.0f} real tokens/s", flush=True)
    med = {label: statistics.median(v) for label, v in rates.items()}
    base = med[f"one length ({largest}, documents apart)"]
    rows = [
        "| run | padding (share of training positions) | real tokens/s (median) | vs one length |",
        "|---|---|---|---|",
    ]
    for label in runs:
        rows.append(
            f"| {label} | {100 * padding[label]:.1f}% | {med[label]:.0f} | "
            f"{med[label] / base:.3f}x |"
        )
    text = "\n".join(
        [
            "# Buckets in `pdjax train`: padding and real tokens per second",
            "",
            f"`python benchmarks/bench_train_buckets.py --buckets {args.buckets} --rounds "
            f"{args.rounds} --epoch-steps {args.epoch_steps} --batch-size {args.batch_size} "
            f"--microbatches {args.microbatches}` (Llama {args.config}, text-bpe "
            f"of {args.vocab} tokens, 1f1b on {args.devices} CPU devices, batch "
            f"{args.batch_size} in {args.microbatches} microbatches, {args.epochs} epochs of "
            f"{args.epoch_steps} steps, the first left out; medians of {args.rounds} "
            "interleaved rounds in one process).",
            "",
            *rows,
            "",
        ]
    )
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
