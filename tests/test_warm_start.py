"""drafter.init_from=DIR: a run starts from an existing export (specdistill/drafters/warm_start.py).

Drafter level (fast): every speculators-format export reloads into the drafter its config.json describes with the
same weights and the same drafts; a setting the user gave that the export contradicts, an export of another target
or method, and a stale EAGLE-3 vocabulary mapping each stop with an error naming them. Run level (vLLM): a second
run started from a first run's export begins where the first ended (its step-0 held-out tau is the first run's final
one, same rows and dtype), and its own export serves on vLLM with tau_vllm = tau_offline (fp32).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdistill.core.batch import PackedBatch
from specdistill.core.contract import TokenizedRow
from specdistill.core.run_dir import RunDir
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.drafters import build_drafter, drafter_config

SMALL = {"eagle3": {"target_layer_ids": [1, 2, 3], "num_speculative_tokens": 3},
         "dflash": {"num_layers": 1, "target_layer_ids": [1, 3], "block_size": 4, "init_from_target": False},
         "dspark": {"num_layers": 1, "target_layer_ids": [1, 3], "block_size": 4, "init_from_target": False,
                    "markov_rank": 8},
         "dflash2": {"num_layers": 1, "target_layer_ids": [1, 3], "block_size": 4, "init_from_target": False,
                     "selector_rank": 8}}
ROWS = [TokenizedRow(i, tuple(range(3 + i, 40 + i)), (0,) * 20 + (1,) * 17) for i in range(4)]


class NoTokenizer:
    """tiny_llama_dir has no tokenizer: one that knows 200 tokens, so DFlash's mask token is embedding row 200
    (specdistill/drafters/base.py choose_mask_token)."""

    mask_token = unk_token_id = unk_token = None

    def __len__(self):
        return 200

    def convert_tokens_to_ids(self, token):
        return None


def _built(name, target_dir, overrides):
    info = TargetInfo.load(target_dir)
    drafter = build_drafter(drafter_config(name, overrides), info, NoTokenizer())
    drafter.prepare(ROWS)
    if overrides.get("init_from"):
        drafter.load_export(Path(overrides["init_from"]))
    return info, drafter.eval()


def _batch(info, layer_ids):
    g = torch.Generator().manual_seed(0)
    T = 44
    return PackedBatch(torch.randint(0, info.vocab_size, (T,), generator=g), torch.arange(T) >= 12,
                       torch.randn(T, len(layer_ids), info.hidden_size, generator=g),
                       torch.zeros(T, dtype=torch.long), torch.arange(T), tuple(layer_ids), (0,))


def _exported(name, tiny_llama_dir, out, **extra):
    torch.manual_seed(1)
    info, drafter = _built(name, tiny_llama_dir, {**SMALL[name], **extra})
    drafter.export(out, info)
    return info, drafter


@pytest.mark.parametrize("name", ["eagle3", "dflash", "dspark", "dflash2"])
def test_an_export_reloads_as_the_same_drafter(tiny_llama_dir, tmp_path, name):
    info, first = _exported(name, tiny_llama_dir, tmp_path / "export")
    _, warm = _built(name, tiny_llama_dir, {"init_from": str(tmp_path / "export")})  # architecture from config.json
    assert warm.state_dict().keys() == first.state_dict().keys()
    for key, value in first.state_dict().items():
        assert torch.equal(warm.state_dict()[key], value), key  # fp32 target: the export is fp32
    batch = _batch(info, first.feature_spec().layer_ids)
    anchors = torch.tensor([14, 20, 27])
    head = TargetHead(info)
    assert torch.equal(warm.propose(batch, head, anchors), first.propose(batch, head, anchors))


def test_a_published_dflash_layout_reads_as_the_same_drafter(tiny_llama_dir, tmp_path):
    """The DFlash authors' layout: a Qwen3 config with dflash_config {mask_token_id, target_layer_ids}, where a
    layer id j names the output of decoder layer j (0-based): ours + 1 (vLLM's eagle3_utils adds the 1)."""
    info, first = _exported("dflash", tiny_llama_dir, tmp_path / "export")
    ours = json.loads((tmp_path / "export/config.json").read_text())
    published = tmp_path / "published"
    published.mkdir()
    tensors = load_file(str(tmp_path / "export/model.safetensors"))
    tensors["embed_tokens.weight"] = TargetHead(info).embed_tokens.weight.clone()  # some carry the target's table
    save_file(tensors, str(published / "model.safetensors"))
    config = {**ours["transformer_layer_config"], "architectures": ["DFlashDraftModel"], "block_size": 4,
              "dflash_config": {"mask_token_id": ours["mask_token_id"],
                                "target_layer_ids": [i - 1 for i in ours["aux_hidden_state_layer_ids"]]}}
    (published / "config.json").write_text(json.dumps(config))
    _, warm = _built("dflash", tiny_llama_dir, {"init_from": str(published)})
    assert warm.target_layer_ids == first.target_layer_ids == [1, 3]
    assert warm.mask_token_id == first.mask_token_id and not warm.cfg.causal_in_block
    for key, value in first.state_dict().items():
        assert torch.equal(warm.state_dict()[key], value), key


def test_a_reduced_eagle3_vocabulary_survives_the_round_trip(tiny_llama_dir, tmp_path):
    _, first = _exported("eagle3", tiny_llama_dir, tmp_path / "export", draft_vocab_size=64)
    assert first.uses_draft_vocab and "d2t" in load_file(str(tmp_path / "export/model.safetensors"))
    # Another run's rows would choose another vocabulary: the export's mapping must win (its lm_head rows fit it).
    info = TargetInfo.load(tiny_llama_dir)
    warm = build_drafter(drafter_config("eagle3", {"init_from": str(tmp_path / "export")}), info, NoTokenizer())
    warm.prepare([TokenizedRow(0, tuple(range(150, 256)), (1,) * 106)])
    assert not torch.equal(warm.draft_ids, first.draft_ids)
    warm.load_export(tmp_path / "export")
    assert torch.equal(warm.draft_ids, first.draft_ids) and torch.equal(warm.t2d, first.t2d)
    warm.export(tmp_path / "again", info)
    again = load_file(str(tmp_path / "again/model.safetensors"))
    assert torch.equal(again["d2t"], first.d2t) and torch.equal(again["t2d"], first.t2d)


@pytest.mark.parametrize("stale", ["d2t_shifted", "t2d_of_another_vocab"])
def test_a_stale_eagle3_vocabulary_mapping_is_refused(tiny_llama_dir, tmp_path, stale):
    _exported("eagle3", tiny_llama_dir, tmp_path / "export", draft_vocab_size=64)
    file = tmp_path / "export/model.safetensors"
    tensors = load_file(str(file))
    draft_ids = torch.arange(64) + tensors["d2t"]
    if stale == "d2t_shifted":  # the mapping of a vocabulary 100 ids further on; lm_head rows still the old ones
        tensors["d2t"] = (draft_ids + 100).clamp(max=255) - torch.arange(64)
        tensors["t2d"] = torch.zeros(256, dtype=torch.bool)
        tensors["t2d"][(draft_ids + 100).clamp(max=255)] = True
    else:
        tensors["t2d"] = torch.roll(tensors["t2d"], 1)
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="stale|different vocabularies|out of order"):
        _built("eagle3", tiny_llama_dir, {"init_from": str(tmp_path / "export")})


def test_a_setting_the_export_contradicts_is_an_error_naming_both(tiny_llama_dir, tmp_path):
    _exported("dflash", tiny_llama_dir, tmp_path / "export")
    with pytest.raises(ValueError, match=r"drafter.block_size=16 but .*config.json has 4"):
        _built("dflash", tiny_llama_dir, {"init_from": str(tmp_path / "export"), "block_size": 16})
    # The same value as the export's is no contradiction, and a training setting is the run's own.
    _built("dflash", tiny_llama_dir, {"init_from": str(tmp_path / "export"), "block_size": 4, "max_anchors": 16})


def test_an_export_of_another_target_or_method_is_refused(tiny_llama_dir, tmp_path, tiny_target):
    _exported("dflash", tiny_llama_dir, tmp_path / "export")
    with pytest.raises(ValueError, match="a 'dflash' export, but the run trains drafter=eagle3"):
        _built("eagle3", tiny_llama_dir, {"init_from": str(tmp_path / "export")})
    other = tiny_target("tiny-qwen3-next")
    with pytest.raises(ValueError, match=r"hidden size 64, but the target .* has hidden size"):
        build_drafter(drafter_config("dflash", {"init_from": str(tmp_path / "export")}), TargetInfo.load(other),
                      NoTokenizer())
    deep = json.loads((tmp_path / "export/config.json").read_text())
    deep["aux_hidden_state_layer_ids"] = [1, 9]
    (tmp_path / "export/config.json").write_text(json.dumps(deep))
    with pytest.raises(ValueError, match=r"reads target layers \[1, 9\], but the target .* has 4 layers"):
        _built("dflash", tiny_llama_dir, {"init_from": str(tmp_path / "export")})


def test_mtp_starts_from_another_checkpoints_mtp_layer(tmp_path, tiny_target):
    from specdistill.drafters.mtp import MTPConfig, MTPDrafter

    info = TargetInfo.load(tiny_target("tiny-qwen3-next"))
    tuned = MTPDrafter(MTPConfig(num_speculative_tokens=2), info)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(0.01 * torch.randn_like(p))
    tuned.export(tmp_path / "export", info)
    warm = build_drafter(drafter_config("mtp", {"init_from": str(tmp_path / "export")}), info, None)
    for key, value in tuned.state_dict().items():
        assert torch.allclose(warm.state_dict()[key], value, atol=1e-2 * value.abs().max().item() + 1e-6), key
    fresh = MTPDrafter(MTPConfig(), info)
    assert not torch.equal(fresh.fc.weight, warm.fc.weight)


# --- a run started from another run's export ---------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.slow
def test_a_warm_run_starts_where_the_first_ended_and_serves(tmp_path, cache_dir, tiny_target, target_alone_runs):
    from tests.cli import run_train
    from tests.serving_helpers import SERVED_TRAIN, assert_lossless, served_run

    target_dir = tiny_target("tiny-llama")
    train = ["drafter=eagle3", "target=tiny-llama",
             *[a for a in SERVED_TRAIN if not a.startswith("drafter.init_from_target")]]
    first = tmp_path / "first"
    run_train([*train, "trainer.export=last", f"hydra.run.dir={first}"], cache_dir)
    first_metrics = json.loads(RunDir(first).metrics.read_text())
    assert first_metrics["heldout_curve"][-1]["step"] == first_metrics["steps"]

    second = tmp_path / "second"
    shutil.copytree(RunDir(first).export, tmp_path / "start")  # a published drafter, as users would have it
    run_train([*[a for a in train if not a.startswith("trainer.max_steps")], "trainer.max_steps=10",
               f"drafter.init_from={tmp_path / 'start'}", f"hydra.run.dir={second}"], cache_dir)
    metrics = json.loads(RunDir(second).metrics.read_text())
    start = metrics["heldout_curve"][0]
    assert start["step"] == 0
    assert start["heldout_tau"] == pytest.approx(first_metrics["heldout_curve"][-1]["heldout_tau"], abs=1e-9)
    assert start["heldout_tau"] > 1.3  # the first run learned something the second one starts from

    served = served_run("tiny-llama", second, target_dir, "eagle3", target_alone_runs)
    assert_lossless(served)
    vllm, ours = served["spec"].counters, served["offline"]
    assert vllm.num_accepted_tokens > 0
    assert vllm.num_drafts == ours.num_drafts and list(vllm.accepted_per_pos) == list(ours.accepted_per_pos)
