"""The trainer's frozen target head reproduces the target's own logits, in both norm conventions."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdistill.core.target import TargetHead, TargetInfo
from tests.files import build_random_target


# Unfitted targets: the head's arithmetic and the norm convention do not depend on what the weights learned, and
# the fitted tiny-qwen3.5-moe is built by make test-all only (tests/launch/test_targets.py).
@pytest.mark.parametrize("name, zero_centred", [("tiny-qwen3-next", True), ("tiny-qwen3.5-moe", True),
                                                ("tiny-llama", False)])
def test_head_logits_equal_the_targets(tmp_path_factory, name, zero_centred):
    path = build_random_target(name, tmp_path_factory)
    info = TargetInfo.load(path)
    assert info.zero_centred_norm is zero_centred
    head = TargetHead(info)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    captured = {}

    def keep_input(module, args, output):  # returns None: a forward hook's return value would replace the output
        captured["pre_norm"] = args[0]

    model.model.norm.register_forward_hook(keep_input)
    ids = torch.randint(0, info.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
        ours = head.logits(captured["pre_norm"][0])
    torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-4)
    # A norm convention mix-up is not a small error: the other convention must be far off.
    wrong = TargetHead(info)
    wrong.norm.zero_centred = not zero_centred
    assert (wrong.logits(captured["pre_norm"][0]) - logits).abs().max() > 1e-2


def test_unsupported_architecture_names_it_and_the_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*supported: \['llama'"):
        TargetInfo.load(tmp_path)
