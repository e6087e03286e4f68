"""--tiny-model-layers / --tiny-model-hidden: the size of the model the job makes."""

from __future__ import annotations

import json

from slime_like.config.parse import parse_args
from slime_like.config.slices import job_settings
from slime_like.job.inputs import prepare_inputs


def test_the_job_makes_the_tiny_model_the_flags_ask_for(tmp_path):
    args = parse_args(["--config", "configs/quickstart.yaml", "--tiny-model-layers", "1",
                       "--tiny-model-hidden", "32"])
    inputs = prepare_inputs(job_settings(args), tmp_path)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert inputs.model_path == str(tmp_path / "model")
    assert (config["num_hidden_layers"], config["hidden_size"]) == (1, 32)
