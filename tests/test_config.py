"""Configs are strict: a mistyped key fails at compose time, in files and on the command line."""

import pytest
from omegaconf import OmegaConf

from specdistill.launch.config import compose_config as compose_run


def test_default_composes_to_typed_groups():
    cfg = compose_run([])
    assert cfg.drafter.name == "dflash" and cfg.target.name == "tiny-qwen3-next"
    drafter = OmegaConf.to_object(cfg.drafter)
    assert type(drafter).__name__ == "DFlashConfig"


@pytest.mark.parametrize("override", ["trainer.stpes=3", "drafter.blok_size=4", "feature_server.wrokers=2"])
def test_unknown_key_fails(override):
    with pytest.raises(Exception, match="not in struct|Could not override|Key .* not in"):
        compose_run([override])


def test_wrong_type_fails():
    with pytest.raises(Exception, match="max_steps"):
        compose_run(["trainer.max_steps=many"])


def test_target_path_overrides_name():
    cfg = compose_run(["target.path=/models/x"])
    assert cfg.target.path == "/models/x"


def test_gpu1_layout_puts_the_worker_on_the_trainers_gpu():
    """specdistill/conf/layout/gpu1.yaml composes through the feature_server schema, whose share_trainer_device is a bool."""
    cfg = compose_run(["layout=gpu1"])
    assert (cfg.trainer.ranks, cfg.trainer.device) == (1, "cuda")
    fs = cfg.feature_server
    assert (fs.backend, fs.workers, fs.device, fs.share_trainer_device) == ("hf", 1, "cuda", True)
    assert compose_run([]).feature_server.share_trainer_device is False
    with pytest.raises(Exception, match="share_trainer_device"):
        compose_run(["feature_server.share_trainer_device=sometimes"])
