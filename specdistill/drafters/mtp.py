"""MTP / FastMTP: fine-tune the target's own multi-token-prediction layer (Qwen3-Next / Qwen3.5 `mtp.*`).

Semantics follow vLLM 0.32's Qwen3NextMTP (models/qwen3_next_mtp.py) and its proposer
(v1/spec_decode/llm_base_proposer.py), which serve the export:
  - one step: x = fc(cat[pre_fc_norm_embedding(emb(token)), pre_fc_norm_hidden(h)])  (embedding FIRST),
    then one full-attention Qwen3-Next decoder layer (gated attention: q_proj yields [query | gate] per head,
    zero-centred q_norm/k_norm, partial NeoX RoPE; sparse MoE MLP with a sigmoid-gated shared expert),
    then s = mtp.norm(x). Logits = target lm_head(s) (shared, frozen; no target final norm on top).
  - step 1 of a draft from anchor p (last verified token): h = the target's output state at p-1, which in
    vLLM is the target model's return value, i.e. AFTER its final norm: head.norm(layer L) here; token = t_p;
    RoPE position p-1 (the target's position of h).
  - step k > 1: h = s_{k-1} (the post-mtp.norm state: Qwen3NextMTP returns one tensor, used for logits and
    fed back), token = the step-(k-1) draft, position p+k-2.
  - attention: the MTP layer keeps its own KV cache. Every target forward re-runs step 1 over all verified
    positions j (inputs h_j, t_{j+1}), so a step-k query sees those entries for j < p-1 plus its own chain's
    entries of steps 1..k. That is DFlash's anchor-block mask with anchor p-1 and a causal block of k slots.
  - vLLM calls layers[0] at every step (Qwen3NextMTP.forward passes no spec_step_idx); only layers.0 is trained.
Training unrolls K steps from every sampled response anchor, teacher-forcing ground-truth tokens (FastMTP);
step k's CE to the target's greedy token is weighted beta^(k-1) / sum_j beta^(j-1).

Suffixes: T packed tokens, N anchors (chains), K steps, D hidden, H heads, d head dim, E experts.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdistill.core.batch import PackedBatch
from specdistill.core.contract import FeatureSpec
from specdistill.core.target import RMSNorm, TargetHead, TargetInfo
from specdistill.drafters.base import Drafter, StepOutput, block_metrics, sample_anchors
from specdistill.drafters.layers import Rotary, apply_rotary
from specdistill.drafters.mtp_checkpoint import read_mtp_state, write_back_mtp
from specdistill.kernels.attention import anchor_block_plan
from specdistill.kernels.logits import chunked_argmax, chunked_loss
from specdistill.kernels.moe import SparseMoeBlock


@dataclass
class MTPConfig:
    name: str = "mtp"
    num_speculative_tokens: int = 5  # K: steps unrolled in training and drafted when served
    loss_decay: float = 0.6  # beta: step k's CE weighs beta^(k-1) / sum_j beta^(j-1)
    max_anchors: int = 1024  # chains per packed sequence
    attention_impl: str = "auto"  # specdistill.kernels.attention impls: auto | flex | chunked | reference
    moe_impl: str = "auto"  # specdistill.kernels.moe impls: auto | grouped | reference
    init_from: str | None = None  # a checkpoint whose mtp.* tensors to start from instead of the target's


def step_weights(K: int, beta: float) -> torch.Tensor:
    """[K] weights beta^(k-1) / sum_{j=1..K} beta^(j-1)."""
    w = beta ** torch.arange(K, dtype=torch.float64)
    return (w / w.sum()).float()


@dataclass(frozen=True)
class MTPShape:
    """The MTP layer's geometry, read from the target's config.json (text_config for VL wrappers)."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    eps: float
    num_experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int
    norm_topk_prob: bool
    num_mtp_layers: int

    @classmethod
    def of(cls, target: TargetInfo) -> "MTPShape":
        raw = json.loads((target.path / "config.json").read_text())
        text = raw.get("text_config") or raw
        n_mtp = text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers") or 0
        if not n_mtp or not text.get("num_experts"):
            raise ValueError(f"{target.path}/config.json: model_type={target.model_type!r} has no MoE MTP head "
                             "(num_nextn_predict_layers / mtp_num_hidden_layers, num_experts); drafter=mtp needs a "
                             "qwen3_next or qwen3_5_moe checkpoint with mtp.* tensors")
        if not text.get("attn_output_gate", True):
            raise ValueError(f"{target.path}/config.json: attn_output_gate=false is not supported by drafter=mtp")
        rope = text.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        return cls(hidden=target.hidden_size, num_heads=target.num_attention_heads,
                   num_kv_heads=target.num_key_value_heads, head_dim=target.head_dim,
                   rotary_dim=int(target.head_dim * factor), rope_theta=target.rope_theta, eps=target.rms_norm_eps,
                   num_experts=text["num_experts"], top_k=text["num_experts_per_tok"],
                   moe_intermediate=text["moe_intermediate_size"],
                   shared_intermediate=text["shared_expert_intermediate_size"],
                   norm_topk_prob=bool(text.get("norm_topk_prob", True)), num_mtp_layers=int(n_mtp))


class GatedAttention(nn.Module):
    """Qwen3-Next full attention: q_proj -> per head [query | gate]; out = o_proj(attn * sigmoid(gate))."""

    def __init__(self, s: MTPShape):
        super().__init__()
        self.s = s
        self.scale = s.head_dim**-0.5
        self.q_proj = nn.Linear(s.hidden, 2 * s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.eps, zero_centred=True)
        self.k_norm = RMSNorm(s.head_dim, s.eps, zero_centred=True)

    def rope(self, x_PHd, cos_sin):
        """Partial NeoX RoPE: only the first rotary_dim dims of each head rotate."""
        r = self.s.rotary_dim
        return torch.cat([apply_rotary(x_PHd[..., :r], *cos_sin), x_PHd[..., r:]], dim=-1)

    def queries(self, x_ND, cos_sin):
        q, gate = self.q_proj(x_ND).view(x_ND.shape[0], self.s.num_heads, 2 * self.s.head_dim).chunk(2, dim=-1)
        return self.rope(self.q_norm(q), cos_sin), gate

    def keys_values(self, x_ND, cos_sin):
        shape = (x_ND.shape[0], self.s.num_kv_heads, self.s.head_dim)
        k = self.rope(self.k_norm(self.k_proj(x_ND).view(shape)), cos_sin)
        return k, self.v_proj(x_ND).view(shape)

    def output(self, attn_NHd, gate_NHd):
        return self.o_proj((attn_NHd * torch.sigmoid(gate_NHd)).flatten(1))


class MTPLayer(nn.Module):
    """Names as the checkpoint's mtp.layers.i.* (self_attn.*, mlp.* after fuse_expert_weights, two norms)."""

    def __init__(self, s: MTPShape, moe_impl: str):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps, zero_centred=True)
        self.self_attn = GatedAttention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps, zero_centred=True)
        self.mlp = SparseMoeBlock(s.hidden, s.num_experts, s.top_k, s.moe_intermediate, s.shared_intermediate,
                                  s.norm_topk_prob, impl=moe_impl)


class MTPDrafter(Drafter):
    name = "mtp"

    def __init__(self, cfg: MTPConfig, target: TargetInfo):
        super().__init__()
        if cfg.num_speculative_tokens < 1:
            raise ValueError(f"drafter.num_speculative_tokens={cfg.num_speculative_tokens}; must be >= 1")
        self.cfg, self.target = cfg, target
        self.shape = s = MTPShape.of(target)
        D = s.hidden
        # Zero-centred (1 + w) norms, as every Qwen3-Next / Qwen3.5 norm (vLLM: GemmaRMSNorm).
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.pre_fc_norm_hidden = RMSNorm(D, s.eps, zero_centred=True)
        self.pre_fc_norm_embedding = RMSNorm(D, s.eps, zero_centred=True)
        self.layers = nn.ModuleList([MTPLayer(s, cfg.moe_impl)])  # layers.0 only: the one vLLM runs
        self.norm = RMSNorm(D, s.eps, zero_centred=True)
        self.rotary = Rotary(s.rotary_dim, s.rope_theta)
        self.load_state_dict(read_mtp_state(self.weights_source(), self.state_dict()))

    def weights_source(self) -> Path:
        """The checkpoint whose mtp.* tensors start the run: drafter.init_from (an export of drafter=mtp, or any
        checkpoint with an MTP layer of this shape) or the target itself."""
        if not self.cfg.init_from:
            return self.target.path
        source = Path(self.cfg.init_from)
        theirs = MTPShape.of(TargetInfo.load(source))
        differ = [f"{k}: {v} vs the target's {getattr(self.shape, k)}" for k, v in vars(theirs).items()
                  if v != getattr(self.shape, k)]
        if differ:
            raise ValueError(f"drafter.init_from={source}: its MTP layer has another shape than the target's: "
                             + "; ".join(differ))
        return source

    def load_export(self, path: Path) -> None:
        """Nothing left to do: __init__ read the mtp.* tensors from drafter.init_from (weights_source)."""

    @classmethod
    def build(cls, cfg: MTPConfig, target: TargetInfo, tokenizer) -> "MTPDrafter":
        return cls(cfg, target)

    @property
    def num_speculative_tokens(self) -> int:
        return self.cfg.num_speculative_tokens

    def feature_spec(self) -> FeatureSpec:
        # Layer L (pre-final-norm): the target's final norm of it is what vLLM feeds step 1, and the trainer's
        # target distribution comes from it too.
        return FeatureSpec((self.target.num_hidden_layers,))

    def input_layer_ids(self) -> list[int]:
        return [self.target.num_hidden_layers]

    # --- forward -----------------------------------------------------------------------------------
    def fuse(self, head: TargetHead, tokens_N: torch.Tensor, hidden_ND: torch.Tensor) -> torch.Tensor:
        """fc over [norm(embedding) ; norm(hidden)]: vLLM concatenates the embedding first."""
        emb = head.embed_tokens(tokens_N).to(hidden_ND.dtype)
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden_ND)], dim=-1))

    def unroll(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor, teacher_tokens: bool):
        """Post-mtp.norm states [N, K, D] of the K steps from each anchor p (chain start p-1).

        teacher_tokens: step k > 1 reads t_{p+k-1} (training); else its own greedy draft (serving). Returns
        (states_NKD, drafts_NK or None)."""
        layer, attn, K = self.layers[0], self.layers[0].self_attn, self.num_speculative_tokens
        T = batch.num_tokens
        target_TD = head.norm(batch.layers([self.target.num_hidden_layers])[:, 0])  # what vLLM feeds the MTP
        next_T = batch.input_ids_T[torch.arange(1, T + 1, device=anchors_N.device).clamp(max=T - 1)]
        # The MTP KV cache as vLLM fills it: step 1 over every position j with inputs (h_j, t_{j+1}).
        ctx_x_TD = self.fuse(head, next_T, target_TD)
        k_ctx, v_ctx = attn.keys_values(layer.input_layernorm(ctx_x_TD), self.rotary(batch.position_ids_T))
        starts_N = anchors_N - 1
        x_ND = ctx_x_TD[starts_N]
        pos_N = batch.position_ids_T[starts_N]
        qs, gates, ks, vs, states, drafts = [], [], [], [], [], []
        for k in range(1, K + 1):
            if k > 1:
                tokens = batch.input_ids_T[(anchors_N + k - 1).clamp(max=T - 1)] if teacher_tokens else drafts[-1]
                x_ND = self.fuse(head, tokens, states[-1])
            a_ND = layer.input_layernorm(x_ND)
            cos_sin = self.rotary(pos_N + k - 1)
            q, gate = attn.queries(a_ND, cos_sin)
            kk, vv = attn.keys_values(a_ND, cos_sin)
            qs.append(q), ks.append(kk), vs.append(vv)
            out_NHd = self.chain_attention(batch, starts_N, qs, ks, vs, k_ctx, v_ctx)
            r_ND = x_ND + attn.output(out_NHd, gate)
            states.append(self.norm(r_ND + layer.mlp(layer.post_attention_layernorm(r_ND))))
            if not teacher_tokens:
                drafts.append(chunked_argmax(states[-1], head.lm_head.weight))
        return torch.stack(states, dim=1), (torch.stack(drafts, dim=1) if drafts else None)

    def chain_attention(self, batch, starts_N, qs, ks, vs, k_ctx, v_ctx) -> torch.Tensor:
        """Step-k queries [N, H, d] over cache entries j < start (own document) + the chain's k own entries.

        The plan is DFlash's anchor-block mask (anchor = chain start, causal block of k slots); the queries of
        earlier slots are recomputed and discarded, since their outputs were already used. With the run's fixed
        shapes (batch.static) every step's block is padded with zero slots to K, after the real ones (causal: no
        real slot sees them), so compiled attention sees one block size, not K."""
        N, k = starts_N.shape[0], len(qs)
        slots = self.num_speculative_tokens if batch.static is not None else k
        plan = anchor_block_plan(batch.document_ids_T, starts_N, slots, None, causal_in_block=True,
                                 impl=self.cfg.attention_impl, static=batch.static)
        pad = (0, 0, 0, 0, 0, slots - k)  # [N, k, H, d] -> [N, slots, H, d]
        q = F.pad(torch.stack(qs, dim=1), pad).flatten(0, 1).transpose(0, 1)
        key = torch.cat([k_ctx, F.pad(torch.stack(ks, dim=1), pad).flatten(0, 1)]).transpose(0, 1)
        val = torch.cat([v_ctx, F.pad(torch.stack(vs, dim=1), pad).flatten(0, 1)]).transpose(0, 1)
        return plan(q, key, val, self.layers[0].self_attn.scale).view(N, slots, *qs[0].shape[1:])[:, k - 1]

    def label_positions(self, batch: PackedBatch, anchors_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token positions [N, K] step k predicts (p + k), and which carry loss in the anchor's document."""
        T = batch.num_tokens
        pos_NK = anchors_N[:, None] + torch.arange(1, self.num_speculative_tokens + 1, device=anchors_N.device)
        clamped = pos_NK.clamp(max=T - 1)
        valid = (pos_NK < T) & batch.loss_mask_T[clamped]
        valid &= batch.document_ids_T[clamped] == batch.document_ids_T[anchors_N][:, None]
        return clamped, valid

    def select_anchors(self, batch: PackedBatch, generator: torch.Generator) -> torch.Tensor:
        """Response tokens with a predecessor in their document (step 1 reads the target state at p-1)."""
        candidates = torch.nonzero(batch.loss_mask_T & (batch.position_ids_T > 0)).squeeze(-1)
        return sample_anchors(candidates, self.cfg.max_anchors, generator)

    def training_step(self, batch: PackedBatch, head: TargetHead, generator: torch.Generator) -> StepOutput:
        anchors_N = self.select_anchors(batch, generator)
        pos_NK, valid_NK = self.label_positions(batch, anchors_N)
        # The target's token at p+k, from its state before; a state is the label of up to K chains: once each.
        states_U, index_M = torch.unique(pos_NK[valid_NK] - 1, return_inverse=True)
        last_UD = batch.layer_at(self.target.num_hidden_layers, states_U)
        target_M = head.argmax(last_UD)[index_M]
        states_NKD, _ = self.unroll(batch, head, anchors_N, teacher_tokens=True)
        hidden_MD = states_NKD[valid_NK]
        rows = chunked_loss("ce", hidden_MD, head.lm_head.weight, labels_M=target_M)  # response-only, chunked
        ce_M = rows.loss
        ce_NK = torch.zeros(valid_NK.shape, device=ce_M.device).masked_scatter(valid_NK, ce_M)
        per_step_K = ce_NK.sum(0) / valid_NK.sum(0).clamp(min=1)
        w_K = step_weights(self.num_speculative_tokens, self.cfg.loss_decay).to(per_step_K.device)
        loss = (w_K * per_step_K).sum()
        correct_NK = torch.zeros_like(valid_NK).masked_scatter(valid_NK, rows.draft_token == target_M)
        return block_metrics(loss, correct_NK, valid_NK)

    @torch.no_grad()
    def propose(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        if bool((batch.position_ids_T[anchors_N] == 0).any()):
            raise ValueError("MTP anchors need a predecessor in their document (position_ids > 0)")
        return self.unroll(batch, head, anchors_N, teacher_tokens=False)[1]

    def draft_logits(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        return head.lm_head(self.unroll(batch, head, anchors_N, teacher_tokens=True)[0])

    # --- export ------------------------------------------------------------------------------------
    def export(self, out_dir: Path, target: TargetInfo) -> None:
        """A copy of the target checkpoint (hardlinks where possible) with the tuned mtp.* tensors written back
        into the safetensors file(s) holding them; vLLM serves it with method="mtp"."""
        write_back_mtp(target.path, Path(out_dir), self.state_dict())
