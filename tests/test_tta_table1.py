"""``benchmarks/tta.py``'s statistical efficiency (Table 1, row by row), on hand-made rows of
``cluster-tta/tta.json``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import jax
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tta.py"


@pytest.fixture(scope="module")
def tta() -> ModuleType:
    """The script as a module. It sets ``jax_num_cpu_devices`` to 4 at import, which would
    change (or, once JAX has run, fail on) the 8 devices the tests run with: that one call
    is skipped while it loads."""
    spec = importlib.util.spec_from_file_location("tta_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    update = jax.config.update

    def keep_devices(name, value):
        if name != "jax_num_cpu_devices":
            update(name, value)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax.config, "update", keep_devices)
        spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def row(study, link, runner, seeds, epochs):
    return {
        "study": study,
        "link_mbit": link,
        "runner": runner,
        "seeds": seeds,
        "epochs_to_target": epochs,
    }


ROWS = [
    row("digits", None, "single", [0, 1], [3, 3]),
    # The slow link's rows differ: only the smallest link is read.
    row("digits", 1000.0, "dp", [0, 1], [99, 99]),
    row("digits", 1000.0, "pipedream", [0, 1], [1, 1]),
    row("digits", 100.0, "dp", [0, 1], [4, 6]),
    row("digits", 100.0, "pipedream", [0, 1], [5, 6]),
    row("digits", 100.0, "1f1b", [0, 1], [4, 6]),
    row("text", 100.0, "dp", [0, 1], [2, None]),
    row("text", 100.0, "pipedream", [0, 1], [4, 3]),
    row("text", 100.0, "1f1b", [0, 1], [None, None]),
]


def test_mean_of_dp_over_schedule_where_both_reached(tta):
    eff = tta.statistical_efficiency(ROWS, "pipedream")
    # digits seeds 0, 1: 4/5, 6/6; text seed 0: 2/4; text seed 1: DP missed, left out.
    assert eff.pairs == 3
    assert eff.value == pytest.approx((4 / 5 + 1 + 2 / 4) / 3)
    assert eff.notes == ()


def test_notes_where_the_schedule_never_reached_the_target(tta):
    eff = tta.statistical_efficiency(ROWS, "1f1b")
    assert eff.pairs == 2 and eff.value == pytest.approx(1.0)
    assert eff.notes == ("text: 1f1b never reached the target",)


def test_partial_misses_missing_runners_and_no_pairs(tta):
    rows = [
        row("digits", 10.0, "dp", [0, 1], [4, 4]),
        row("digits", 10.0, "2bw", [0, 1], [None, 8]),
        row("text", 10.0, "dp", [0], [3]),
    ]
    eff = tta.statistical_efficiency(rows, "2bw")
    assert eff.pairs == 1 and eff.value == pytest.approx(0.5)
    assert eff.notes == (
        "digits: 2bw reached the target in 1 of 2 seeds",
        "text: no 2bw runs",
    )
    none = tta.statistical_efficiency(rows[2:], "2bw")
    assert none.value is None and none.pairs == 0


def test_table_without_the_measurements(tta):
    (awd,) = [t for t in tta.TABLE1 if t.profile is None]
    results = [
        tta.Table1Result(tta.TABLE1[0], "12rr-1-1-1-1", 1.5, 5),
        tta.Table1Result(tta.TABLE1[2], "16rr", 1.0, 1),
        tta.Table1Result(awd, "not modelled: no GPU profile", None, 0),
    ]
    absent = "\n".join(tta.table1_section(results, None))
    assert "| 1.50x | - (run benchmarks/cluster/tta.py) | - | **-** |" in absent
    assert "| 1.00x | 1 (the plan is DP) | 1.00x | **1.00x** |" in absent
    assert "| AWD-LM | 1x4 (A) | straight | 4.25x (not verified) | not modelled" in absent
    measured = "\n".join(tta.table1_section(results, ROWS))
    x = (4 / 5 + 1 + 2 / 4) / 3
    assert f"| 1.50x | {x:.2f} / - | {1.5 * x:.2f}x | **-** |" in measured  # no single-mb
    with_control = ROWS + [
        {"study": st, "link_mbit": None, "runner": "single-mb", "seeds": [0, 1],
         "epochs_to_target": [2, 2]}
        for st in dict.fromkeys(r["study"] for r in ROWS)
    ]  # fmt: skip
    stale = tta.statistical_efficiency(with_control, "pipedream", baseline="single-mb")
    assert stale.pairs == 4 and stale.value == pytest.approx((2 / 5 + 2 / 6 + 2 / 4 + 2 / 3) / 4)
    both = "\n".join(tta.table1_section(results, with_control))
    assert f"| 1.50x | {x:.2f} / {stale.value:.2f} | {1.5 * x:.2f}x | " in both
    assert f"**{1.5 * stale.value:.2f}x** |" in both
