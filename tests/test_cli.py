"""The command line: ``pdjax profile`` on every model, models of your own
(``--model package.module:factory``), errors as exit status 2, help and version, ``plan``'s
warning and ``simulate``'s schedule lists."""

import argparse
import json
import sys

import pytest

import pdjax
from pdjax.apps.cli import build_parser, main
from pdjax.models import MODELS
from pdjax.profile import Profile
from pdjax.schedules import SCHEDULES

#: Profiled twice, to check the output does not change. Determinism is the profiler's
#: property, not a model's: a feed-forward model and a recurrent one check it (a second
#: run costs seconds of tracing per model); every model is profiled once.
TWICE = ("mlp", "awd_lm")


@pytest.mark.parametrize("model", MODELS)
def test_profile_every_tiny_model(model, capsys, tmp_path):
    out = tmp_path / "p.json"
    argv = ["profile", "--model", model, "--batch-size", "4", "--json", "--out", str(out)]
    assert main(argv) == 0
    first = capsys.readouterr().out
    if model in TWICE:  # deterministic
        assert main(argv) == 0
        assert capsys.readouterr().out == first
    prof = Profile.from_json(first)
    assert Profile.load(out) == prof
    assert prof.batch_size == 4 and prof.meta["model"] == model
    assert all(layer.forward_flops > 0 for layer in prof.layers)


def test_profile_table_with_device_model(capsys):
    assert main(["profile", "--model", "mlp", "--device-model", "h100", "--batch-size", "8"]) == 0
    text = capsys.readouterr().out
    assert "fwd FLOPs" in text and "total" in text and "times: model:h100" in text


def test_profile_measured_times(capsys):
    assert main(["profile", "--model", "mlp", "--measure", "--repeats", "2", "--json"]) == 0
    prof = Profile.from_json(capsys.readouterr().out)
    assert prof.time_source.startswith("measured:cpu") and prof.has_times


def test_errors_exit_with_status_2_and_a_message(capsys):
    assert main(["profile", "--model", "mlp", "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1" in capsys.readouterr().err
    assert main(["profile", "--model", "mlp", "--measure", "--device-model", "v100"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["profile", "--model", "resnet18"]) == 2  # validated by pdjax, not argparse
    err = capsys.readouterr().err
    assert "unknown model 'resnet18'" in err and "package.module:factory" in err
    assert all(name in err for name in MODELS)


def test_json_is_plain_json(capsys):
    main(["profile", "--model", "mlp", "--batch-size", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "pdjax.profile/1" and len(data["layers"]) == 4


# -- models of your own -----------------------------------------------------------------------

MODELS_PY = """
import flax.linen as nn
import numpy as np
import optax

import pdjax
from pdjax.models import CustomModel

SEEN = {}


def _loss(out, y):
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def _sample(rows=3):
    return (np.zeros((rows, 12), np.float32), np.zeros((rows,), np.int32))


def build(config="tiny"):
    SEEN["config"] = config
    width = {"tiny": 8, "paper": 24}[config]
    return CustomModel(
        layers=pdjax.sequential(nn.Dense(width), nn.relu, nn.Dense(5)),
        loss=_loss,
        sample_batch=_sample(),
    )


def as_dict():
    return {"layers": [nn.Dense(6), nn.Dense(5)], "loss_fn": _loss, "sample_batch": _sample}


def no_args():
    return build()


def wrong():
    return 42


def needs(width):
    return build()


def missing_loss():
    return {"layers": [nn.Dense(5)], "sample_batch": _sample()}


def bad_sample():
    return {"layers": [nn.Dense(5)], "loss": _loss, "sample_batch": np.zeros((3, 12))}


SPEC = {"layers": [nn.Dense(5)], "loss": _loss, "sample_batch": _sample()}
"""


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    """A module ``usermodels`` in a fresh current directory (not otherwise on the path)."""
    (tmp_path / "usermodels.py").write_text(MODELS_PY)
    (tmp_path / "broken.py").write_text("import flax\nraise RuntimeError('boom at import')\n")
    (tmp_path / "typo.py").write_text("def build(:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for name in ("usermodels", "broken", "typo"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield tmp_path
    for name in ("usermodels", "broken", "typo"):
        sys.modules.pop(name, None)


def _profile(capsys, model, *extra):
    code = main(["profile", "--model", model, "--batch-size", "4", "--json", *extra])
    captured = capsys.readouterr()
    return code, captured


@pytest.mark.parametrize(
    ("ref", "layers", "params"),
    [
        ("usermodels:build", 3, 12 * 8 + 8 + 8 * 5 + 5),  # module form, factory(config=)
        ("usermodels:as_dict", 2, 12 * 6 + 6 + 6 * 5 + 5),  # dict, list of layers, a sampler
        ("usermodels:no_args", 3, 12 * 8 + 8 + 8 * 5 + 5),  # a factory without arguments
        ("usermodels:SPEC", 1, 12 * 5 + 5),  # a model object, not a factory
        ("usermodels.py:build", 3, 12 * 8 + 8 + 8 * 5 + 5),  # a file
    ],
)
def test_profile_a_model_of_your_own(user_models, capsys, ref, layers, params):
    code, captured = _profile(capsys, ref)
    assert code == 0, captured.err
    prof = Profile.from_json(captured.out)
    assert prof.batch_size == 4 and len(prof.layers) == layers
    assert prof.meta["model"] == ref
    assert sum(layer.param_bytes for layer in prof.layers) == 4 * params


def test_a_factory_gets_config_when_it_takes_it(user_models, capsys):
    code, captured = _profile(capsys, "usermodels:build", "--config", "paper")
    assert code == 0 and sys.modules["usermodels"].SEEN == {"config": "paper"}
    prof = Profile.from_json(captured.out)
    assert sum(layer.param_bytes for layer in prof.layers) == 4 * (12 * 24 + 24 + 24 * 5 + 5)
    code, captured = _profile(capsys, "usermodels:build", "--config", "huge")
    assert code == 2  # the factory's own error, as one line (PDJAX_DEBUG=1: its traceback)
    assert "the factory usermodels:build failed: KeyError: 'huge'" in captured.err


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("nosuchmodule:build", ["cannot import 'nosuchmodule'", "current directory"]),
        ("usermodels:buld", ["has no attribute 'buld'", "build", "as_dict"]),
        ("usermodels:wrong", ["returned is a int", "CustomModel(layers="]),
        ("usermodels:needs", ["needs ['width']", "defaults"]),
        ("usermodels:missing_loss", ["a dict without loss"]),
        ("usermodels:bad_sample", ["must be one batch (x, y)"]),
        (
            "broken:build",
            ["importing 'broken' failed", "RuntimeError: boom at import", "broken.py:2"],
        ),
        ("typo:build", ["typo.py:1: syntax error"]),
        ("usermodels", ["unknown model 'usermodels'", "package.module:factory"]),
        ("missing/file.py:build", ["no such file"]),
    ],
)
def test_model_errors_say_what_to_do(user_models, capsys, ref, expected):
    code, captured = _profile(capsys, ref)
    assert code == 2 and captured.out == ""
    for text in expected:
        assert text in captured.err, captured.err


def test_bench_runs_a_model_of_your_own(user_models, capsys):
    argv = ["bench", "--model", "usermodels:build", "--devices", "2", "--plan", "even"]
    argv += ["--batch-size", "8", "--microbatches", "2", "--steps", "1", "--repeats", "1"]
    assert main([*argv, "--schedules", "1f1b,dp", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "usermodels:build"
    rows = {row["name"]: row for row in result["rows"]}
    assert set(rows) == {"1f1b", "dp"} and all(r["samples_per_second"] > 0 for r in rows.values())
    assert main([*argv, "--model", "nosuchmodule:build"]) == 2
    assert "cannot import 'nosuchmodule'" in capsys.readouterr().err


# -- help, version ------------------------------------------------------------------------------


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"pdjax {pdjax.__version__}"


def _parsers():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [("pdjax", parser), *subparsers.choices.items()]


def test_every_parser_shows_defaults_and_every_option_has_help():
    parsers = _parsers()
    assert {name for name, _ in parsers} >= {"pdjax", "profile", "plan", "simulate", "train"}
    for name, parser in parsers:
        assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter), name
        for action in parser._actions:
            if action.option_strings and action.help != argparse.SUPPRESS:
                assert action.help and action.help.strip(), f"{name} {action.option_strings}"
    train = " ".join(dict(parsers)["train"].format_help().split())
    assert "(default: 4)" in train and "(default: pipedream)" in train
    assert "(default: None)" not in train  # nothing to show: left out


def test_subcommand_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 1f1b)" in out and "M, microbatches per step (default: 8)" in out
    assert "(default)" not in out  # no default said twice


# -- plan: slower than one device ---------------------------------------------------------------


def test_plan_warns_when_slower_than_one_device(capsys):
    slow = ["plan", "--model", "mlp", "--device-model", "h100", "--workers", "4"]
    assert main([*slow, "--bandwidths", "1e3", "--json"]) == 0
    captured = capsys.readouterr()
    plan = json.loads(captured.out)
    assert plan["time_per_microbatch"] > plan["single_device_time"]
    assert "warning: this plan" in captured.err and "SLOWER than one device" in captured.err
    assert "--fewer-machines" in captured.err
    assert main([*slow, "--bandwidths", "1e3", "--fewer-machines"]) == 0  # one device: no warning
    assert "warning" not in capsys.readouterr().err
    assert main(["plan", "--profile", "pipedream:vgg16", "--preset", "4x4-v100-10gbps"]) == 0
    captured = capsys.readouterr()
    assert "speedup 12" in captured.out and "warning" not in captured.err


def test_plan_needs_a_profile_or_a_model(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--workers", "2"])
    assert "--profile" in capsys.readouterr().err
    assert (
        main(["plan", "--profile", "pipedream:vgg16", "--workers", "2", "--device-model", "h100"])
        == 2
    )
    assert "give --model" in capsys.readouterr().err


# -- simulate: schedule lists ---------------------------------------------------------------------


def _simulate(capsys, schedules, *extra):
    argv = ["simulate", "--unit-costs", "1,1,1", "--stages", "4", "--microbatches", "8"]
    code = main([*argv, "--schedule", schedules, "--json", *extra])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out)["schedules"] if code == 0 else captured.err)


def test_simulate_takes_a_comma_list_like_train_compare(capsys):
    code, rows = _simulate(capsys, "gpipe, 1f1b,pipedream-nostash")
    assert code == 0
    assert [r["name"] for r in rows] == ["gpipe", "1f1b", "pipedream-nostash"]
    assert [r["schedule"] for r in rows] == ["gpipe", "1f1b", "pipedream"]
    assert rows[0]["bubble_fraction"] == pytest.approx(rows[1]["bubble_fraction"])
    assert not rows[2]["weight_stashing"]
    code, every = _simulate(capsys, "all")
    assert code == 0 and len(every) == len(SCHEDULES) == 8
    # a schedule that cannot run is a row in a list, an error alone
    code, rows = _simulate(capsys, "1f1b,2bw", "--microbatches", "2")
    assert code == 0 and "error" in rows[1] and "error" not in rows[0]
    code, err = _simulate(capsys, "2bw", "--microbatches", "2")
    assert code == 2 and "2bw" in err
    for bad in ("1f1b,ring", "1f1b,1f1b", ","):
        code, err = _simulate(capsys, bad)
        assert code == 2 and "--schedule" in err and "comma-separated" in err, (bad, err)


def test_simulate_writes_and_reads_torch_csv_schedules(tmp_path, capsys):
    out = tmp_path / "zb.csv"
    args = ["simulate", "--unit-costs", "1,1,1", "--stages", "3", "--microbatches", "6"]
    assert main([*args, "--schedule", "zb-h1", "--write-csv", str(out), "--json"]) == 0
    written = json.loads(capsys.readouterr().out)["schedules"][0]
    assert len(out.read_text().splitlines()) == 3  # one row per rank
    common = ["simulate", "--unit-costs", "1,1,1", "--json"]
    assert main([*common, "--schedule-csv", str(out), "--csv-name", "zb-h1"]) == 0
    read = json.loads(capsys.readouterr().out)["schedules"][0]
    assert read["step_time"] == written["step_time"] and read["bubble_fraction"] > 0
    assert main([*common, "--schedule-csv", str(out), "--csv-name", "zb-h1", "--stages", "2"]) == 2
    assert "disagrees with the 3 ranks" in capsys.readouterr().err
    assert main([*args, "--schedule", "1f1b,gpipe", "--write-csv", str(out)]) == 2
    assert "writes one schedule" in capsys.readouterr().err
