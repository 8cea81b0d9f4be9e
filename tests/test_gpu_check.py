"""``benchmarks/gpu_check.py --tiny``: every code path of the GPU check, on CPU.

The full check runs only on an accelerator, rarely; running its tiny mode here (the same
functions on pdjax's tiny Llama under ``--precision bf16``) keeps it from rotting. The run
is a subprocess, because the script sets process-wide JAX options (the persistent
compilation cache) that must not leak into other tests; it stays within :data:`BUDGET` on
2 cores (~20 s on an idle 2-core machine).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from pdjax.errors import PipelineError
from pdjax.models import LlamaConfig

# counts XLA's compilations: no persistent cache (tests/xla_cache.py)
pytestmark = pytest.mark.no_xla_cache

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
#: A hang guard for the tiny run (nearly all of this file's time): it takes 15-40 s alone
#: and longer next to a busy test suite on 2 cores; this is not a speed check.
BUDGET = 400.0
RUNNERS = [
    "one jit per batch",
    "jit per microbatch, accumulate",
    "jit per microbatch, update each",
    "1f1b",
    "pipedream",
]
LAYERS = ["embed", "block0", "block1", "head"]  # the tiny Llama's (and the tiny GPT's)


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _strict_json(path: Path) -> Any:
    def reject(token: str) -> None:
        raise ValueError(f"{path.name} holds {token}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=reject)


def _finite_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _run_tiny(out: Path, *extra: str) -> str:
    """``gpu_check.py --tiny --out OUT [extra]`` in a subprocess, within :data:`BUDGET`;
    its stdout."""
    # XLA:CPU's backend optimisation level 0 halves its compile times, which are nearly
    # all of this run; the tiny run's CPU timings mean nothing either way.
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags}
    try:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--tiny", "--out", str(out), *extra],
            capture_output=True,
            text=True,
            timeout=BUDGET,
            cwd=ROOT,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        pytest.fail(f"gpu_check.py --tiny ran past its {BUDGET:.0f} s budget:\n{stderr}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _llama_tiny_flops_per_sample() -> float:
    """An independent count of the tiny Llama's training FLOPs per sample: 6 per matmul
    weight and token (forward 2, backward 4) plus the attention's two ``T x T``
    products per layer (forward 2 * 2 * T^2 * d, backward twice that); elementwise work
    (norms, softmax, SwiGLU's product) left out, which XLA's count includes."""
    c = LlamaConfig.tiny()
    kv = c.num_kv_heads * c.head_dim
    block = 2 * c.d_model**2 + 2 * c.d_model * kv + 3 * c.d_model * c.hidden_dim
    matmul_weights = c.num_layers * block + c.d_model * c.vocab_size  # the head; embed gathers
    attention = c.num_layers * 3 * 2 * 2 * c.seq_len**2 * c.d_model
    return 6.0 * matmul_weights * c.seq_len + attention


def test_tiny_llama_bf16_run(tmp_path: Path) -> None:
    # One run, not several sharing a fixture (under pytest-xdist each worker would run the
    # script again): the Llama family under the mixed policy, every part. The GPT family
    # differs only in the spec it builds (test_build_spec_families_and_precisions).
    stdout = _run_tiny(tmp_path, "--model", "llama", "--precision", "bf16", "--rounds", "1")
    _check_outputs(tmp_path, stdout)
    md = (tmp_path / "results.md").read_text()
    for word in ("Llama tiny", "bfloat16 compute", "bfloat16 peak"):
        assert word in md, word
    results = _strict_json(tmp_path / "results.json")
    _check_environment_and_config(results)
    cfg = results["config"]
    assert cfg["family"] == "llama" and cfg["precision"] == "bf16"
    assert cfg["rounds"] == 1
    assert cfg["num_params"] == 28_832  # LlamaConfig.tiny(): the docstring's count
    _check_throughput(results)
    _check_losses_agree(results)
    _check_compilation(results)
    _check_profile(results)
    assert results["mfu"]["dtype"] == "bfloat16"
    _check_mfu(results, reference_flops=_llama_tiny_flops_per_sample())


def _check_mfu(results: dict[str, Any], reference_flops: float | None) -> None:
    mfu = results["mfu"]
    per_sample, peak = mfu["flops_per_sample"], mfu["peak_tflops"] * 1e12
    assert _finite_positive(per_sample) and _finite_positive(peak)
    assert mfu["peak_source"].startswith("measured matmul (cpu")
    if reference_flops is not None:  # XLA's count: the analytic one plus elementwise work
        assert reference_flops <= per_sample <= 1.25 * reference_flops, (
            per_sample,
            reference_flops,
        )
    for r in results["throughput"]["rows"]:
        achieved = r["samples_per_second"] * per_sample
        assert math.isclose(r["model_tflops"], achieved / 1e12, rel_tol=1e-9), r["runner"]
        assert math.isclose(r["mfu"], achieved / peak, rel_tol=1e-9), r["runner"]


def _check_outputs(out: Path, stdout: str) -> None:
    for name in ("results.md", "results.json", "profile-measured.json", "profile-predicted.json"):
        assert (out / name).stat().st_size > 0, name
    md = (out / "results.md").read_text()
    assert md.strip() == stdout.strip()  # printed and written alike
    for word in (*RUNNERS, *LAYERS, "Roofline (model:h200)", "Total error", "cpu", "MFU"):
        assert word in md, word


def _check_environment_and_config(results: dict[str, Any]) -> None:
    assert results["complete"] is True
    env, cfg = results["environment"], results["config"]
    assert env["platform"] == "cpu" and env["jax"] and env["device_kind"]
    assert cfg["mode"] == "tiny" and cfg["model"] == "tiny"
    assert cfg["num_params"] > 0 and cfg["num_layers"] == len(LAYERS)
    assert cfg["batch"] == cfg["microbatches"] * cfg["microbatch"]
    assert cfg["placement"].count("all stages on device 0") == 2  # 1f1b and pipedream
    assert cfg["rounds"] >= 1


def _check_throughput(results: dict[str, Any]) -> None:
    tp = results["throughput"]
    rows = {r["runner"]: r for r in tp["rows"]}
    assert list(rows) == RUNNERS
    for name, r in rows.items():
        for key in (
            "samples_per_second",
            "ms_per_step",
            "ratio_vs_jit",
            "dispatches_per_step",
            "model_tflops",
            "mfu",
        ):
            assert _finite_positive(r[key]), (name, key, r[key])
        assert math.isfinite(r["final_loss"]), name
        assert len(r["round_seconds"]) == results["config"]["rounds"]
    assert rows["one jit per batch"]["ratio_vs_jit"] == 1.0
    assert rows["one jit per batch"]["dispatches_per_step"] == 1
    m = results["config"]["microbatches"]
    assert rows["jit per microbatch, accumulate"]["dispatches_per_step"] == m + 1
    assert rows["jit per microbatch, update each"]["dispatches_per_step"] == 2 * m
    for name in ("1f1b", "pipedream"):
        assert _finite_positive(rows[name]["host_us_per_action"]), name
        assert _finite_positive(rows[name]["ratio_vs_floor"]), name
        # at least a forward and a backward per stage and microbatch
        assert rows[name]["dispatches_per_step"] >= 2 * results["config"]["stages"] * m
    assert set(tp["goal_met"]) == {"1f1b", "pipedream"}


def _check_losses_agree(results: dict[str, Any]) -> None:
    agreement = results["throughput"]["loss_agreement"]
    assert len(agreement) == 4
    for name, rel in agreement.items():
        assert rel < 1e-4, (name, rel)


def _check_compilation(results: dict[str, Any]) -> None:
    comp = results["compilation"]
    assert comp["timed_rounds"]["compiles"] == 0
    assert set(comp["warmup"]) == set(RUNNERS)
    assert all(c["compiles"] >= 1 for c in comp["warmup"].values())
    # the two floors share their gradient program: the persistent cache has it
    assert comp["warmup"]["jit per microbatch, update each"]["cache_hits"] >= 1
    assert comp["profile"]["compiles"] >= 1


def _check_profile(results: dict[str, Any]) -> None:
    pr = results["profile"]
    assert pr["measured_source"].startswith("measured:cpu")
    assert pr["predicted_source"] == "model:h200"
    assert [r["name"] for r in pr["layers"]] == LAYERS
    assert [r["name"] for r in pr["stages"]] == [f"stage {s}" for s in range(4)]
    for r in [*pr["layers"], *pr["stages"], pr["total"]]:
        for key in ("measured_fwd_ms", "measured_bwd_ms", "measured_ms", "predicted_ms"):
            assert _finite_positive(r[key]), (r["name"], key)
        assert math.isfinite(r["error"]) and r["error"] > -1, r["name"]
    total = sum(r["measured_ms"] for r in pr["layers"])
    assert math.isclose(pr["total"]["measured_ms"], total, rel_tol=1e-9)
    assert math.isclose(sum(r["measured_ms"] for r in pr["stages"]), total, rel_tol=1e-9)


def test_stages_share_device_zero_and_fall_back_if_refused() -> None:
    gpu_check = _load_script()
    plan = gpu_check.shared_plan(26, 4)
    assert [(s.first_layer, s.last_layer) for s in plan] == [(0, 6), (7, 12), (13, 19), (20, 25)]
    assert {s.devices for s in plan} == {(0,)}

    built = []

    def refuses_sharing(layers, plan, loss, optimizer, **kwargs):
        devices = [s.devices for s in plan]
        if len(devices) > len(set(devices)):
            raise PipelineError("two stages on one device")
        built.append(devices)
        return "pipeline"

    medium = gpu_check.build_spec("350m")
    assert len(medium.layers) == 26 and 350e6 < medium.num_params() < 380e6

    spec = gpu_check.build_spec("tiny")
    pipe, note = gpu_check.make_pipeline(
        spec, None, "1f1b", gpu_check.TINY, pipeline_cls=refuses_sharing
    )
    assert pipe == "pipeline" and "refused (two stages on one device)" in note
    n = len(jax.devices())
    assert built == [[(s % n,) for s in range(4)]]


def test_build_spec_families_and_precisions() -> None:
    gpu_check = _load_script()
    llama = gpu_check.build_spec("350m", "llama")
    assert llama.name == "llama" and len(llama.layers) == 26
    # LlamaConfig.paper() (336,118,784 params, by its docstring), without dropout
    assert llama.model_config == dataclasses.replace(LlamaConfig.paper(), dropout=0.0)

    # Every runner takes the spec's layers: under bf16 they (and so the one-jit baseline)
    # compute in bfloat16 on the same float32 weights; in float32 nothing is bfloat16.
    def jaxpr(family: str, precision: str) -> str:
        spec = gpu_check.build_spec("tiny", family, precision)
        x, _ = spec.sample_batch(2, 0)
        variables = jax.eval_shape(spec.layers.init, jax.random.key(0), x)
        assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(variables))

        def forward(v: Any) -> Any:
            return spec.layers.apply(v, x, train=True, rng=jax.random.key(1))[0]

        return str(jax.make_jaxpr(forward)(variables))

    for family in gpu_check.MODELS:
        assert "bf16[" in jaxpr(family, "bf16") and "bf16[" not in jaxpr(family, "float32")
    assert gpu_check.compute_dtype("bf16") == "bfloat16"
    assert gpu_check.compute_dtype("float32") == "float32"
    with pytest.raises(ValueError, match="family"):
        gpu_check.build_spec("tiny", "bert")
    with pytest.raises(ValueError, match="precision"):
        gpu_check.build_spec("tiny", "gpt", "fp8")
