"""Streamed input at two data-set sizes: ``pdjax train`` on a 1 GB token file and on a
10 MB one, and on the 10 MB file's windows held in memory, side by side.

Each run is one ``pdjax.apps.train.train`` call in a process of its own (a fresh process,
so its resident memory is its own): Llama small (its vocabulary the files', 1024 tokens;
windows of ``--seq-len`` tokens) under ``1f1b`` on ``--devices`` CPU devices (an even
plan), ``--epochs`` epochs of ``--epoch-steps`` steps each, every epoch evaluated on the
same small validation file (a second token file, so evaluation costs the same in every
run). The variants:

* **tokens 1 GB** and **tokens 10 MB**: ``dataset="tokens:PATH"``, the file memory-mapped
  and streamed through grain;
* **in memory 10 MB**: the same windows of the 10 MB file read into numpy arrays first
  (``np.asarray`` of the views: the data set held in host memory, the path every data set
  took before streaming).

Per run it reports the process's peak resident memory (``ru_maxrss``), the peak bytes of
live JAX arrays on the devices (sampled after every microbatch's dispatch: the training
state and the calls' inputs), and the samples per second of the epochs after the first
(median). The variants' runs are interleaved ``--rounds`` times (the machine's noise hits
all alike) and the medians compared: the goals are the two token files within 10% of each
other in memory (resident and device) and the streamed 10 MB run within 5% of the
in-memory one in samples per second.

    python benchmarks/bench_stream.py [--large-mb 1024] [--small-mb 10] [--rounds 3]
        [--epochs 3] [--epoch-steps 20] [--dir DIR] [--out benchmarks/results/stream.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 1024
HERE = Path(__file__).resolve().parent


def _child(args: argparse.Namespace) -> None:
    """One run (``--child``): prints one JSON line of its measurements."""
    import resource

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np

    from pdjax.apps.data import Dataset
    from pdjax.apps.train import TrainConfig, build, train

    cfg = TrainConfig(
        model="llama",
        config="small",
        dataset=f"tokens:{args.file}",
        validation=args.validation,
        schedule="1f1b",
        devices=args.devices,
        plan="even",
        epochs=args.epochs,
        epoch_steps=args.epoch_steps,
        batch_size=args.batch_size,
        microbatches=args.microbatches,
        seq_len=args.seq_len,
        learning_rate=1e-3,
    )
    spec, ds = build(cfg)
    if args.variant == "memory":
        ds = Dataset(
            ds.name,
            np.asarray(ds.train_x),
            np.asarray(ds.train_y),
            np.asarray(ds.test_x),
            np.asarray(ds.test_y),
            ds.num_classes,
            ds.info,
        )
    peak = {"device": 0}

    def sample(_done: int, _total: int) -> None:
        live = sum(a.nbytes for a in jax.live_arrays())
        peak["device"] = max(peak["device"], live)

    t0 = time.perf_counter()
    result = train(cfg, built=(spec, ds), on_progress=sample)
    rates = [r.samples_per_second for r in result.history[1:]] or [
        result.history[-1].samples_per_second
    ]
    print(
        json.dumps(
            {
                "variant": args.variant,
                "file": str(args.file),
                "file_bytes": os.path.getsize(args.file),
                "train_windows": ds.num_train,
                "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "device_bytes": peak["device"],
                "samples_per_second": statistics.median(rates),
                "seconds": time.perf_counter() - t0,
                "final_loss": result.history[-1].train_loss,
            }
        )
    )


def _make_files(folder: Path, large_mb: int, small_mb: int) -> dict[str, Path]:
    from pdjax.apps.data.tokens import write_random_tokens

    files = {
        "large": folder / f"tokens-{large_mb}mb.bin",
        "small": folder / f"tokens-{small_mb}mb.bin",
        "validation": folder / "validation.bin",
    }
    sizes = {"large": large_mb << 19, "small": small_mb << 19, "validation": 1 << 16}  # uint16
    for key, path in files.items():
        if not path.exists():
            t0 = time.perf_counter()
            write_random_tokens(path, sizes[key], VOCAB, seed=len(key))
            print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
    return files


def _number(value: object) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--large-mb", type=int, default=1024)
    p.add_argument("--small-mb", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--epoch-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--dir", type=Path, default=None, help="where the token files are made")
    p.add_argument("--out", type=Path, default=HERE / "results" / "stream.md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="tokens", help=argparse.SUPPRESS)
    p.add_argument("--file", default="", help=argparse.SUPPRESS)
    p.add_argument("--validation", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    folder = args.dir or Path(tempfile.mkdtemp(prefix="pdjax-bench-stream-"))
    folder.mkdir(parents=True, exist_ok=True)
    files = _make_files(folder, args.large_mb, args.small_mb)
    variants = [
        (f"tokens {args.large_mb} MB", "tokens", files["large"]),
        (f"tokens {args.small_mb} MB", "tokens", files["small"]),
        (f"in memory {args.small_mb} MB", "memory", files["small"]),
    ]
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in variants}
    common = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("epochs", "epoch_steps", "batch_size", "microbatches", "seq_len", "devices")
    ]
    for r in range(args.rounds):
        for label, variant, path in variants:
            cmd = [sys.executable, __file__, "--child", f"--variant={variant}", f"--file={path}",
                   f"--validation={files['validation']}", *common]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode:
                sys.exit(f"{label} failed:\n{out.stderr[-4000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            runs[label].append(got)
            print(f"round {r + 1} {label}: {got}", flush=True)
    med = {
        label: {k: statistics.median(x[k] for x in rs) for k, v in rs[0].items() if _number(v)}
        for label, rs in runs.items()
    }
    large, small, memory = (med[label] for label, _, _ in variants)
    rows = [
        "| run | file | train windows | peak resident (MiB) | peak device bytes (MiB) "
        "| samples/s (median) |",
        "|---|---|---|---|---|---|",
    ]
    for label, _, _ in variants:
        m = med[label]
        rows.append(
            f"| {label} | {m['file_bytes'] / 2**20:.0f} MiB | {m['train_windows']:.0f} | "
            f"{m['rss_bytes'] / 2**20:.0f} | {m['device_bytes'] / 2**20:.2f} | "
            f"{m['samples_per_second']:.0f} |"
        )
    rss = large["rss_bytes"] / small["rss_bytes"]
    dev = large["device_bytes"] / small["device_bytes"]
    speed = small["samples_per_second"] / memory["samples_per_second"]
    verdict = [
        f"- resident memory, 1 GB file / 10 MB file: **{rss:.3f}** (goal within 10%: "
        f"{'met' if abs(rss - 1) <= 0.10 else 'missed'})",
        f"- device bytes, 1 GB file / 10 MB file: **{dev:.3f}** (goal within 10%: "
        f"{'met' if abs(dev - 1) <= 0.10 else 'missed'})",
        f"- samples/s, streamed 10 MB / in memory 10 MB: **{speed:.3f}** (goal within 5%: "
        f"{'met' if abs(speed - 1) <= 0.05 else 'missed'})",
    ]
    text = "\n".join(
        [
            "# Streamed input: a 1 GB token file against a 10 MB one and against memory",
            "",
            f"`python benchmarks/bench_stream.py --rounds {args.rounds} --epochs {args.epochs} "
            f"--epoch-steps {args.epoch_steps}` (Llama small, vocabulary {VOCAB}, windows of "
            f"{args.seq_len} tokens, 1f1b on {args.devices} CPU devices, batch "
            f"{args.batch_size} in {args.microbatches} microbatches; medians of "
            f"{args.rounds} interleaved rounds, each run a fresh process).",
            "",
            *rows,
            "",
            *verdict,
            "",
        ]
    )
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
