"""The committed realistic target (specdistill/launch/assets/small-real) and the script that made it."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdistill.core.target import TargetInfo
from specdistill.data.corpus import corpus_files, digest
from specdistill.launch.assets import SMALL_REAL_DIR
from specdistill.launch.small_real import DIGEST_STEPS, heldout_loss, make_small_real, own_sample_entropy

BUILD_INFO = json.loads((SMALL_REAL_DIR / "build_info.json").read_text())


def test_committed_checkpoint_is_a_real_small_lm():
    info = TargetInfo.load(SMALL_REAL_DIR)
    assert (info.model_type, info.num_hidden_layers, info.hidden_size, info.torch_dtype) == ("llama", 6, 256, "float32")
    tokenizer = AutoTokenizer.from_pretrained(SMALL_REAL_DIR)
    assert tokenizer.convert_tokens_to_ids("<|mask|>") is not None and len(tokenizer) == info.vocab_size
    model = AutoModelForCausalLM.from_pretrained(SMALL_REAL_DIR, dtype=torch.float32).eval()
    # Measured here, not read from build_info.json: next-token loss on held-out corpus files it never trained on,
    # against the same windows under a random model of the same shape (~log 4096 = 8.3 nats: no knowledge).
    held = [f for f in corpus_files() if f.heldout][:8]
    text_T = torch.cat([tokenizer(f.text, return_tensors="pt").input_ids[0][:256] for f in held])
    with torch.no_grad():
        trained = heldout_loss(model, text_T, seq_len=128, max_windows=8)
        torch.manual_seed(0)
        untrained = heldout_loss(AutoModelForCausalLM.from_config(model.config).eval(), text_T, 128, 8)
    assert trained < 4.0 and untrained > 7.5, (trained, untrained)
    if digest(corpus_files()) == BUILD_INFO["corpus_digest"]:  # the build's figure was on these files' corpus
        assert abs(trained - BUILD_INFO["heldout_loss_nats"]) < 0.75, (trained, BUILD_INFO["heldout_loss_nats"])
    ids = tokenizer("def add(a, b):\n    return", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 6.0  # a trained model, far below log(4096) = 8.3 of a uniform guess
    # The builder's two measurements (build_info.json's held-out loss and own-sample entropy), run small here: the
    # replay below skips them. Python source it never trained on (this repository's), a few nats per token.
    text_T = tokenizer(Path(__file__).read_text(), return_tensors="pt").input_ids[0]
    assert heldout_loss(model, text_T, seq_len=64, max_windows=2) < 6.0
    assert 0.5 < own_sample_entropy(model, [text_T[:32].tolist()], new_tokens=16) < 8.3


@pytest.mark.slow
@pytest.mark.long
def test_the_builder_reproduces_the_committed_tokenizer_and_first_steps(tmp_path):
    files = corpus_files()
    if digest(files) != BUILD_INFO["corpus_digest"]:
        pytest.skip("this Python's standard library is not the corpus small-real was built from "
                    f"(torch {BUILD_INFO['torch']}, corpus {BUILD_INFO['corpus_digest'][:12]})")
    # measure=False: the replays skip the held-out loss and own-sample entropy, which nothing here reads.
    out = make_small_real(tmp_path / "replay", steps=DIGEST_STEPS, log=lambda *_: None, measure=False)
    assert (out / "tokenizer.json").read_bytes() == (SMALL_REAL_DIR / "tokenizer.json").read_bytes()
    replay = json.loads((out / "build_info.json").read_text())
    # The first steps' losses equal the committed build's to the 5 decimals recorded. The weights' digest does not
    # match bit for bit (seen: every replay gives 2ac61cfe..., the build recorded 4a52abcc...; the build ran under
    # another process's thread scheduling), so it is not asserted; two replays must agree bit for bit instead.
    assert replay["loss_first"][:DIGEST_STEPS] == BUILD_INFO["loss_first"][:DIGEST_STEPS]
    again = make_small_real(tmp_path / "again", steps=DIGEST_STEPS, log=lambda *_: None, measure=False)
    assert json.loads((again / "build_info.json").read_text())["weights_digest_after_steps"] == \
        replay["weights_digest_after_steps"]
    assert hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest() == BUILD_INFO["tokenizer_sha256"]
