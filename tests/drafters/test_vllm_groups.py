"""vLLM 0.32's KV-cache grouping rule (specdistill/drafters/vllm_groups.py) and the DFlash layers chosen from it."""

import pytest

from specdistill.core.target import TargetInfo
from specdistill.drafters.dflash import DFlashConfig, served_layers
from specdistill.drafters.layers import LayerShape
from specdistill.drafters.vllm_groups import (LINEAR, attention_spec, drafter_in_one_group, max_layers_in_one_group,
                                  target_specs)

FULL = attention_spec("full", 2, 32)
SLIDING = attention_spec("sliding", 2, 32, 2048)
TINY_QWEN3_NEXT = [LINEAR] * 3 + [FULL]  # 3 gated-DeltaNet + 1 full attention
QWEN3_5 = [LINEAR, LINEAR, LINEAR, FULL] * 10  # Qwen3.5-35B-A3B: 30 + 10


@pytest.mark.parametrize("target, drafter, one_group", [
    (TINY_QWEN3_NEXT, [SLIDING] * 2, False),  # measured: "All drafting layers should belong to the same ..."
    (TINY_QWEN3_NEXT, [FULL] * 2, True),  # measured: serves
    (TINY_QWEN3_NEXT, [SLIDING], True),  # one layer is always one group (the tests' 1-layer exports served)
    (TINY_QWEN3_NEXT, [FULL] * 3, True),  # full bucket 4 < 1.5 x 3: group size 4
    (TINY_QWEN3_NEXT, [FULL] * 5, False),  # full bucket 6 >= 4.5: group size 3 splits it
    (QWEN3_5, [SLIDING] * 5, True),  # buckets 30 / 10 / 5: group size 5
    ([FULL] * 4, [SLIDING] * 5, True),  # 4 / 5: 5 < 6, group size 5
    ([FULL] * 40, [attention_spec("full", 8, 128)] * 5, True),  # all full attention: one group, any geometry
    ([FULL] * 4, [SLIDING, FULL], False),  # mixed drafter layers: two buckets
])
def test_grouping_rule(target, drafter, one_group):
    assert drafter_in_one_group(target, drafter) is one_group


def test_target_specs_and_the_most_layers():
    assert target_specs(["linear_attention", "full_attention"], 2, 32) == [LINEAR, FULL]
    with pytest.raises(ValueError, match="mamba"):
        target_specs(["mamba"], 2, 32)
    assert max_layers_in_one_group(TINY_QWEN3_NEXT, FULL) == 3


def _target(tmp_path, layer_types, max_pos=4096):
    import json
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_next", "num_hidden_layers": len(layer_types), "hidden_size": 64, "vocab_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "layer_types": layer_types,
        "max_position_embeddings": max_pos}))
    return TargetInfo.load(tmp_path)


def test_dflash_layers_served_on_each_target(tmp_path):
    hybrid = _target(tmp_path, ["linear_attention"] * 3 + ["full_attention"])
    cfg = DFlashConfig()
    assert served_layers(cfg, hybrid, LayerShape.of(cfg, hybrid)) == (3, "full")  # the default, capped
    two = DFlashConfig(num_layers=2)
    assert served_layers(two, hybrid, LayerShape.of(two, hybrid)) == (2, "full")  # sliding would not group
    five = DFlashConfig(num_layers=5)
    with pytest.raises(ValueError, match=r"drafter.num_layers=5: vLLM 0.32 cannot serve 5 DFlash layers next to "
                                         r"this target \(3 linear_attention, 1 full_attention\).*<= 3"):
        served_layers(five, hybrid, LayerShape.of(five, hybrid))
    one = DFlashConfig(num_layers=1)
    assert served_layers(one, hybrid, LayerShape.of(one, hybrid)) == (1, "sliding")
    (tmp_path / "short").mkdir()
    short = _target(tmp_path / "short", ["full_attention"] * 4, max_pos=2048)  # the window covers the context
    assert served_layers(cfg, short, LayerShape.of(cfg, short)) == (5, "full")
