"""The GPU check's outputs: ``results.json`` (strict JSON) and the markdown report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .sizes import OVERHEAD_GOAL

#: How the report names ``config.family``.
_FAMILIES = {"gpt": "GPT", "llama": "Llama"}


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become ``None`` (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        return _clean(value.item())
    return value


def _write(path: Path, text: str) -> None:
    """Atomically: a reader (or a run cut short) never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_outputs(out: Path, results: dict[str, Any]) -> str:
    """Writes ``results.json`` (strict JSON) and ``results.md``; returns the markdown."""
    _write(out / "results.json", json.dumps(_clean(results), indent=2, allow_nan=False) + "\n")
    text = render_markdown(results)
    _write(out / "results.md", text + "\n")
    return text


def _f(value: Any, fmt: str = ".2f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:{fmt}}{suffix}"


def render_markdown(results: dict[str, Any]) -> str:
    """The report: environment, throughput, loss agreement, profile comparison."""
    lines = _header(results)
    if tp := results.get("throughput"):
        lines += _throughput_section(tp, results.get("mfu"))
    if comp := results.get("compilation"):
        lines += _compilation_section(comp)
    if pr := results.get("profile"):
        lines += _profile_section(pr)
    return "\n".join(lines)


def _header(results: dict[str, Any]) -> list[str]:
    """The title and the table of where and what was measured."""
    env, cfg = results["environment"], results["config"]
    return [
        f"# pdjax GPU check ({cfg['mode']})",
        "",
        "| | |",
        "|---|---|",
        f"| device | {env['device_kind']} ({env['platform']}, {env['device_count']} visible) |",
        f"| jax / jaxlib | {env['jax']} / {env['jaxlib']} |",
        f"| platform version | {env['platform_version']} |",
        f"| matmul precision | {env['matmul_precision']} |",
        f"| model | {_FAMILIES.get(cfg.get('family', 'gpt'), cfg.get('family'))} "
        f"{cfg['model']}: {cfg['num_params']:,} params, {cfg['num_layers']} "
        "layers; " + ", ".join(f"{k}={v}" for k, v in cfg["model_config"].items()) + " |",
        f"| dtype | {cfg['dtype']} |",
        f"| batch | {cfg['batch']} samples per step = {cfg['microbatches']} microbatches of "
        f"{cfg['microbatch']}; steps per round: {cfg['steps']}; median of "
        f"{cfg['rounds']} interleaved rounds after 2 warm-up rounds |",
        f"| optimizer | {cfg['optimizer']} |",
        f"| pipeline | {cfg['stages']} stages, layers {cfg['stage_layers']}; {cfg['placement']} |",
        f"| wall time | {results.get('wall_seconds', math.nan):.0f} s |",
        "",
    ]


def _throughput_section(tp: dict[str, Any], mfu: dict[str, Any] | None) -> list[str]:
    """Machinery overhead per runner, MFU, the goal, and the first step's loss agreement."""
    lines = [
        "## Machinery overhead (same device, same samples)",
        "",
        "| runner | dispatches / step | ms / step | samples/s | vs one jit | "
        "overhead vs jit | vs its floor | host us / action | model TFLOP/s | MFU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in tp["rows"]:
        lines.append(
            f"| {r['runner']} | {r['dispatches_per_step']:.0f} | {r['ms_per_step']:.1f} | "
            f"{r['samples_per_second']:,.1f} | {r['ratio_vs_jit']:.3f}x | "
            f"{r['overhead_vs_jit'] * 100:+.1f}% | "
            f"{_f(r['ratio_vs_floor'], '.3f', 'x')} | "
            f"{_f(r['host_us_per_action'], '.0f')} | {_f(r.get('model_tflops'), '.3g')} | "
            f"{_f(_pct(r.get('mfu')), '.1f', '%')} |"
        )
    lines += [""]
    if mfu:
        lines += [
            f"MFU = model FLOPs per sample ({mfu['flops_per_sample'] / 1e9:.4g} GFLOP: XLA's "
            "cost analysis of the whole model's forward + backward, the optimizer left out) "
            f"x samples/s / the {mfu['dtype']} peak ({mfu['peak_tflops']:.4g} TFLOP/s, "
            f"{mfu['peak_source']})."
            + (
                " Float32 dots run as TF32 (NVIDIA GPUs since Ampere, by default) can "
                "exceed the float32 peak: MFU over 100%."
                if mfu["dtype"] == "float32"
                else ""
            ),
            "",
        ]
    lines += [
        "Overhead = time per sample / one jit's - 1. "
        f"Goal: overhead vs one jit <= {OVERHEAD_GOAL:.0%}: "
        + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in tp["goal_met"].items())
        + ". Floors: 1f1b against the accumulation loop, pipedream against the "
        "update-each loop (it updates every stage after every microbatch).",
        "",
        "First-step loss, relative difference against the accumulation loop (same "
        "weights, same batch): "
        + ", ".join(f"{k} {v:.1e}" for k, v in tp["loss_agreement"].items()),
        "",
    ]
    return lines


def _pct(value: Any) -> Any:
    return None if value is None else 100 * value


def _compilation_section(comp: dict[str, Any]) -> list[str]:
    """Compilations per warm-up, in the timed rounds and in the profile."""
    lines = [
        "## Compilation (XLA backend compiles, persistent-cache hits included)",
        "",
        "| phase | compilations | cache hits | compile s | first + second round s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, c in comp["warmup"].items():
        lines.append(
            f"| warm-up: {name} | {c['compiles']} | {c['cache_hits']} | "
            f"{c['compile_seconds']:.1f} | {c['first_round_seconds']:.1f} + "
            f"{c['second_round_seconds']:.2f} |"
        )
    for name in ("timed_rounds", "profile"):
        if name in comp:
            c = comp[name]
            lines.append(
                f"| {name.replace('_', ' ')} | {c['compiles']} | {c['cache_hits']} | "
                f"{c['compile_seconds']:.1f} | |"
            )
    lines.append("")
    return lines


def _profile_section(pr: dict[str, Any]) -> list[str]:
    """The roofline against measured times: per layer, per stage and in total."""
    dm = pr["device_model"]
    lines = [
        f"## Roofline ({pr['predicted_source']}) vs measured, one microbatch of {pr['batch_size']}",
        "",
        f"Device model {dm['name']}: {dm['dtype']} peak {dm['peak_tflops']:.0f} TFLOP/s, "
        f"memory {dm['memory_tb_per_s']:.2f} TB/s, efficiency {dm['efficiency']:g}; "
        "each layer's forward and backward take max(FLOPs / peak, bytes / bandwidth) "
        "with XLA's counts. Measured: median of timed runs on this device.",
        "",
        "| # | layer / stage | measured fwd ms | measured bwd ms | measured ms | "
        "predicted ms | predicted / measured | error | measured TFLOP/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(pr["layers"]):
        lines.append(_profile_row(str(i), r))
    for r in pr["stages"]:
        lines.append(_profile_row(f"{r['layers'][0]}-{r['layers'][1]}", r))
    lines.append(_profile_row("all", pr["total"], bold=True))
    lines += [
        "",
        f"Total error {pr['total']['error'] * 100:+.1f}%; median |error| per layer "
        f"{pr['median_abs_layer_error'] * 100:.1f}%. Error = predicted / measured - 1.",
        "",
    ]
    if "sum_of_layers_vs_floor" in pr:
        s = pr["sum_of_layers_vs_floor"]
        lines += [
            f"Sum of measured layers per microbatch: {s['sum_of_layers_ms']:.2f} ms; "
            f"accumulation loop per microbatch (incl. its share of the update): "
            f"{s['floor_ms_per_microbatch']:.2f} ms.",
            "",
        ]
    return lines


def _profile_row(index: str, r: dict[str, Any], bold: bool = False) -> str:
    name = f"**{r['name']}**" if bold else r["name"]
    ms = [r[k] for k in ("measured_fwd_ms", "measured_bwd_ms", "measured_ms", "predicted_ms")]
    return (
        f"| {index} | {name} | "
        + " | ".join(_f(v, ".4g") for v in ms)
        + f" | {_f(r['error'] + 1, '.3g')} | {r['error'] * 100:+.1f}% | "
        + f"{_f(r['measured_tflops'], '.3g')} |"
    )
