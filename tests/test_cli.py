"""The command line: ``pdjax profile`` on every model, errors as exit status 2."""

import json

import pytest

from pdjax.cli import main
from pdjax.models import MODELS
from pdjax.profile import Profile


@pytest.mark.parametrize("model", MODELS)
def test_profile_every_tiny_model_is_deterministic(model, capsys, tmp_path):
    out = tmp_path / "p.json"
    argv = ["profile", "--model", model, "--batch-size", "4", "--json", "--out", str(out)]
    assert main(argv) == 0
    first = capsys.readouterr().out
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
    with pytest.raises(SystemExit):
        main(["profile", "--model", "resnet18"])


def test_json_is_plain_json(capsys):
    main(["profile", "--model", "mlp", "--batch-size", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "pdjax.profile/1" and len(data["layers"]) == 4
