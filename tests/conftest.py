"""Session-wide fixtures: tiny checkpoints built once per test session, never downloaded."""

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random 4-layer Llama written with transformers (no tokenizer): for drafter-level tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512)
    path = tmp_path_factory.mktemp("random-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One cache per session: each tiny target and workload is built once, shared by all tests."""
    return tmp_path_factory.mktemp("specdistill-cache")


@pytest.fixture(scope="session")
def tiny_target(cache_dir):
    """tiny_target(name) -> checkpoint dir of a named tiny target, built on first use."""
    from launch.targets import ensure_target

    def build(name: str):
        return ensure_target(name, cache_dir / "targets")

    return build
