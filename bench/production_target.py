"""The production target and the mission's pack at production geometry, shared by the drafter-step benchmarks
(bench/drafter_steps.py, bench/step_flops.py, bench/muon_share.py, bench/positions_ab.py) so that none of them imports
another for its shapes.

The target is Qwen3.5-35B-A3B's text geometry (PRODUCTION) or a CPU-sized one (SMALL); its directory holds config.json
and the three tensors the trainer reads (embeddings, final norm, lm_head), random: a step's time does not depend on
their values.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdistill.core.batch import PackedBatch
from specdistill.core.target import TargetInfo

# Qwen3.5-35B-A3B's text config (the fields the drafters read).
PRODUCTION = dict(hidden_size=2048, num_hidden_layers=40, vocab_size=248320, num_attention_heads=16,
                  num_key_value_heads=2, head_dim=256, num_experts=256, num_experts_per_tok=8,
                  moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=262144)
SMALL = dict(hidden_size=256, num_hidden_layers=8, vocab_size=4096, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
             shared_expert_intermediate_size=128, max_position_embeddings=32768)
DENSE_BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
RESPONSE_TOKENS = 45
ROWS_PER_PACK = 6
MASK_TOKEN_ID = 3


def write_target(path: Path, dims: dict, device) -> TargetInfo:
    """config.json (qwen3_5_moe_text) + random embeddings, final norm and lm_head in bf16."""
    L = dims["num_hidden_layers"]
    config = dict(dims, model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
                  layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (L // 4),
                  rms_norm_eps=1e-6, rope_parameters={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
                  mtp_num_hidden_layers=1, attn_output_gate=True, norm_topk_prob=True, tie_word_embeddings=False,
                  dtype="bfloat16")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator(device).manual_seed(0)
    V, D = dims["vocab_size"], dims["hidden_size"]

    def table():  # drawn on the device: 2 x 509M values
        return (torch.randn(V, D, generator=g, device=device, dtype=torch.bfloat16) * 0.02).cpu()

    save_file({"model.embed_tokens.weight": table(), "model.norm.weight": torch.zeros(D, dtype=torch.bfloat16),
               "lm_head.weight": table()}, path / "model.safetensors")
    return TargetInfo.load(path)


def mission_pack(info: TargetInfo, layer_ids: tuple, pack_tokens: int, device, seed: int = 0,
                 response_tokens: int = RESPONSE_TOKENS) -> PackedBatch:
    """ROWS_PER_PACK rows of uneven length filling `pack_tokens`, each ending in `response_tokens` scored tokens;
    states in bf16 on the device, as the feed delivers them."""
    shares = torch.tensor([1.00, 0.93, 1.08, 0.97, 1.04, 0.98])[:ROWS_PER_PACK]
    lengths = (shares / shares.sum() * pack_tokens).long()
    lengths[-1] += pack_tokens - int(lengths.sum())
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.cat([torch.arange(n) >= n - response_tokens for n in lengths.tolist()])
    hidden = torch.randn(pack_tokens, len(layer_ids), info.hidden_size, generator=g, dtype=torch.bfloat16)
    return PackedBatch(
        input_ids_T=torch.randint(0, info.vocab_size, (pack_tokens,), generator=g).to(device),
        loss_mask_T=loss_mask.to(device),
        hidden_TLD=hidden.to(device),
        document_ids_T=torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device),
        position_ids_T=torch.cat([torch.arange(n) for n in lengths.tolist()]).to(device),
        layer_ids=tuple(layer_ids), row_ids=tuple(range(len(lengths))))
