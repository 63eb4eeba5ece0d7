"""specdistill/evaluation/vllm_serve.py against real vLLM: a DFlash drafter built with speculators' own classes, on the tiny llama.

The drafter is independent of our trainer: speculators' DFlashSpeculatorConfig + DFlashDraftModel, random init,
then a few weights set by hand so that it drafts something the target sometimes accepts (see
`make_speculators_dflash`), which makes the acceptance counters non-trivial. One base engine and one speculative
engine start once for the whole module, one after the other in one engine host (the `comparison` fixture).
"""

import json
import os
import signal
import time

import pytest
import torch

from specdistill.evaluation.vllm_serve import compare, read_prompts, report_lines, serve, speculative_config
from tests.files import build_random_target

pytestmark = pytest.mark.vllm  # engine-starting tests are marked slow too

BLOCK_SIZE = 4
K = BLOCK_SIZE - 1  # speculative tokens per draft (anchor is the bonus token: sample_from_anchor=False)
AUX_LAYER_IDS = [1, 2, 4]  # 4 = the tiny llama's last layer before the final norm
MAX_TOKENS = 24


def make_speculators_dflash(target_dir, out_dir) -> None:
    """A DFlash drafter in speculators format, written by speculators' own save_pretrained.

    Random weights draft tokens the target never accepts, so a few are set by hand: fc reads only the last aux
    layer (the pre-norm state the target's lm_head sees), q_proj = 0 makes attention uniform over the context,
    v_proj = I and o_proj = 20 I let that context mean dominate the mask embedding, and down_proj = 0 drops the
    MLP. The draft is then roughly "the token the target predicted on average so far", which repetitive prompts
    make right part of the time.
    """
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, Qwen3Config

    target = AutoConfig.from_pretrained(target_dir)
    H = target.hidden_size
    layer = Qwen3Config(vocab_size=target.vocab_size, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1,
                        num_attention_heads=H // 32, num_key_value_heads=H // 32, head_dim=32,
                        max_position_embeddings=target.max_position_embeddings, rms_norm_eps=target.rms_norm_eps)
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=target.vocab_size, block_size=BLOCK_SIZE,
        aux_hidden_state_layer_ids=AUX_LAYER_IDS, mask_token_id=target.vocab_size - 1,
        sliding_window_non_causal=True,  # vLLM: causal = not this -> bidirectional in-block attention
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=K)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target_dir), architectures=target.architectures)))
    torch.manual_seed(0)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, -H:] = torch.eye(H)
        attn = model.layers[0].self_attn
        attn.q_proj.weight.zero_()
        attn.v_proj.weight.copy_(torch.eye(H))
        attn.o_proj.weight.copy_(20 * torch.eye(H))
        model.layers[0].mlp.down_proj.weight.zero_()
    model.save_pretrained(out_dir)


def repetitive_prompts(vocab_size: int, n: int = 6) -> list[list[int]]:
    """A varied head then one token repeated: a random target falls into short cycles the drafter can catch."""
    g = torch.Generator().manual_seed(0)
    heads = torch.randint(3, vocab_size - 2, (n, 6), generator=g).tolist()
    tails = torch.randint(3, vocab_size - 2, (n,), generator=g).tolist()
    return [head + [tail] * 10 for head, tail in zip(heads, tails)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_random_target("tiny-llama", tmp_path_factory)


@pytest.fixture(scope="module")
def drafter_dir(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("speculators-dflash")
    make_speculators_dflash(tiny_llama, out)
    return str(out)


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    from transformers import AutoConfig

    return repetitive_prompts(AutoConfig.from_pretrained(tiny_llama).vocab_size)


@pytest.fixture(scope="module")
def comparison(tiny_llama, drafter_dir, prompts):
    # Both engines, one after the other, in one engine host (specdistill/evaluation/engine_host.py)
    return compare(tiny_llama, prompts, MAX_TOKENS, drafter_dir, "dflash", ignore_eos=True, own_process=True)


def test_drafter_checkpoint_is_speculators_dflash(drafter_dir, tiny_llama):
    with open(f"{drafter_dir}/config.json") as f:
        cfg = json.load(f)
    assert cfg["speculators_model_type"] == "dflash"
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["aux_hidden_state_layer_ids"] == AUX_LAYER_IDS
    assert cfg["block_size"] == BLOCK_SIZE and cfg["sample_from_anchor"] is False
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == tiny_llama


@pytest.mark.slow
def test_vllm_served_the_drafter_as_dflash(comparison):
    assert comparison.base.counters is None and comparison.base.method is None
    assert comparison.spec.method == "dflash"
    assert comparison.spec.num_speculative_tokens == K  # read from the speculators config


@pytest.mark.slow
def test_speculative_greedy_outputs_identical_to_base(comparison, prompts):
    # fp32 target: verification is exact, so any difference is a serving bug, not a near-tie.
    assert all(len(o) == MAX_TOKENS for o in comparison.base.output_token_ids)
    assert comparison.spec.output_token_ids == comparison.base.output_token_ids
    assert comparison.identical_outputs == len(prompts)


@pytest.mark.slow
def test_counters_agree_with_the_outputs_and_the_report_prints_them(comparison, prompts):
    """vLLM's acceptance counters against the outputs they produced (an independent source): each request's first
    token comes from prefill and every draft step emits its accepted tokens plus one, so the drafts and accepted
    tokens account for every other output token (up to K per request of a last step cut by max_tokens). The
    report's last lines print those counters: tau = 1 + accepted / drafts, a_k = accepted at k / drafts."""
    c = comparison.spec.counters
    emitted = sum(len(o) - 1 for o in comparison.spec.output_token_ids)
    assert c.num_drafts > 0 and c.num_accepted_tokens > 0  # the hand-set drafter is accepted sometimes
    assert emitted <= c.num_drafts + c.num_accepted_tokens <= emitted + K * len(prompts)
    assert c.num_draft_tokens == c.num_drafts * K and sum(c.accepted_per_pos) == c.num_accepted_tokens
    assert list(c.accepted_per_pos) == sorted(c.accepted_per_pos, reverse=True)  # cumulative: non-increasing
    lines = report_lines(comparison)
    assert [line.split(":")[0] for line in lines[-3:]] == ["identical_outputs", "tau_served", "per_position_acceptance"]
    same = sum(a == b for a, b in zip(comparison.spec.output_token_ids, comparison.base.output_token_ids))
    assert lines[-3] == f"identical_outputs: {same}/{len(prompts)}"
    assert float(lines[-2].split(": ")[1]) == pytest.approx(1 + c.num_accepted_tokens / c.num_drafts, abs=1e-3)
    printed = [float(x) for x in lines[-1].split(": ")[1].split()]
    assert printed == pytest.approx([n / c.num_drafts for n in c.accepted_per_pos], abs=1e-3)


@pytest.mark.slow
def test_vllms_own_process_layout_serves_as_the_engine_host(comparison, tiny_llama, drafter_dir, prompts):
    """serve(own_process=False), a user's default (an engine-core process beside the caller): the same outputs and
    the same acceptance counters as the engine host's second engine of the module (what the suite's served checks
    run: tests/conftest.py sets SPECDISTILL_SERVE_OWN_PROCESS)."""
    layout = serve(tiny_llama, prompts, MAX_TOKENS, drafter_dir, "dflash", ignore_eos=True, own_process=False)
    assert layout.output_token_ids == comparison.spec.output_token_ids
    assert layout.counters == comparison.spec.counters and layout.counters.num_accepted_tokens > 0
    assert (layout.method, layout.num_speculative_tokens) == ("dflash", K)


def test_the_engine_host_is_kept_for_the_next_call_unless_a_call_failed_or_left_numba_imported():
    from specdistill.evaluation import engine_host

    try:
        first = engine_host.run(os.getpid)
        assert first != os.getpid() and engine_host.run(os.getpid) == first
        # What vLLM's n-gram proposer leaves behind (a stand-in module: the rule reads sys.modules)
        engine_host.run(exec, "import sys, types; sys.modules['numba'] = types.ModuleType('numba')")
        second = engine_host.run(os.getpid)
        assert second != first
        with pytest.raises(ValueError, match="invalid literal for int"):  # raised in the host, re-raised here
            engine_host.run(int, "x")
        third = engine_host.run(os.getpid)
        assert third not in (first, second) and engine_host.host_pid() == third
        os.kill(third, signal.SIGKILL)  # ended from outside while idle: the next call gets a fresh host
        deadline = time.monotonic() + 30
        while engine_host._alive(third):  # the host's own test of a live process (not reaped here)
            assert time.monotonic() < deadline, f"process {third} still running 30 s after SIGKILL"
            time.sleep(0.05)
        assert engine_host.run(os.getpid) not in (first, second, third)
    finally:
        engine_host.close()
    assert engine_host.host_pid() is None


def test_own_process_setting_is_checked(tiny_llama, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_SERVE_OWN_PROCESS", "yes")
    with pytest.raises(ValueError, match="SPECDISTILL_SERVE_OWN_PROCESS='yes'"):
        serve(tiny_llama, [[5, 6, 7]], 4)


def test_drafter_without_method_raises(tiny_llama, drafter_dir):
    with pytest.raises(ValueError, match="without method"):
        serve(tiny_llama, [[5, 6, 7]], 4, drafter_dir=drafter_dir)
    with pytest.raises(ValueError, match="without method"):
        compare(tiny_llama, [[5, 6, 7]], 4, drafter_dir, None)


def test_unknown_method_lists_valid_ones(drafter_dir):
    with pytest.raises(ValueError, match="dflash.*eagle3|eagle3.*dflash"):
        speculative_config(drafter_dir, "dlfash", None)


def test_mtp_without_k_raises_before_engine_start(tiny_llama):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        speculative_config(tiny_llama, "mtp", None)


def test_read_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2]}\n\n{"input_ids": [3]}\n')
    assert read_prompts(str(path)) == [[1, 2], [3]]
    path.write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        read_prompts(str(path))


def test_tau_per_step_corrects_for_steps_without_a_draft():
    """2 requests, 10 + 6 output tokens: 14 after the two prefill tokens. 4 drafted steps gave 4 + 6 accepted
    tokens, so 4 steps had no draft: f = 4 / 8 and tokens per step = 14 / 8 = 1 + f * (tau - 1)."""
    from specdistill.evaluation.vllm_serve import ServeResult, SpecCounters

    counters = SpecCounters(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6, accepted_per_pos=(3, 2, 1))
    result = ServeResult([[0] * 10, [0] * 6], "ngram", 3, counters)
    assert counters.tau == 2.5 and result.draft_fraction == 0.5
    assert result.tau_per_step == pytest.approx(14 / 8)
    # A drafter that drafts every step (the last one's accepted tokens cut at max_tokens): f = 1.
    every = ServeResult([[0] * 5], "dflash", 3, SpecCounters(2, 6, 4, (2, 1, 1)))
    assert every.draft_fraction == 1.0 and every.tau_per_step == every.tau
    assert ServeResult([[1]], None, None, None).tau_per_step is None
