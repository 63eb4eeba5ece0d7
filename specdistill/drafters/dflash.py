"""DFlash: a block-parallel drafter conditioned on target hidden states (z-lab DFlash; speculators 0.9.0).

A block is [anchor token, mask x (B-1)]: the anchor is the last token the target verified, the mask
slots are filled with draft tokens in one forward pass. Target states of `target_layer_ids` are fused by
`fc` -> `hidden_norm` and injected as extra K/V context in every drafter layer; queries come from the
block only. All anchors of a packed sequence are trained in one pass, blocks never seeing each other.

Loss: CE to the target's greedy token at each block position, weighted by D-PACE
(q_i = exp(-CE_i) detached, q~_i = (1-alpha) q_i + alpha, w_j = sum_{m>=j} prod_{i<=m} q~_i).

Suffixes: T packed tokens, N anchors, B block size, K = B-1 draft tokens, D hidden, V vocab.
"""

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from specdistill.core.batch import PackedBatch
from specdistill.core.contract import FeatureSpec
from specdistill.core.target import RMSNorm, TargetHead, TargetInfo
from specdistill.drafters.base import (Drafter, StepOutput, block_metrics, choose_mask_token, export_dtype, reads,
                                      sample_anchors, speculators_block)
from specdistill.drafters.layers import (LayerShape, QKVProjections, Rotary, SwiGLU, apply_rotary, init_linear,
                             layer_geometry, speculators_layer_config)
from specdistill.drafters import vllm_groups
from specdistill.drafters.target_init import init_layers_from_target
from specdistill.drafters.targets import DistinctTargets
from specdistill.kernels.attention import anchor_block_plan
from specdistill.kernels.attention.chunked import document_starts, documents_are_contiguous
from specdistill.kernels.attention.static import PaddedContext, pad_documents
from specdistill.kernels.logits import chunked_argmax, chunked_loss

log = logging.getLogger(__name__)


@dataclass
class DFlashConfig:
    """Production defaults (field report): 5 layers, 5 target layers, window 2048, 1024 anchors, block 8."""

    name: str = "dflash"
    num_layers: int | None = None  # None: 5, or fewer where vLLM cannot serve 5 next to the target (served_layers)
    block_size: int = 8
    target_layer_ids: list[int] | None = None  # None: spread num_target_layers over depth
    num_target_layers: int = 5
    # Attention geometry: None copies the target's (as z-lab drafters do).
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None  # None: the target's dense MLP width, else 3 x hidden
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None  # None: the target's
    sliding_window: int | None = 2048  # None: full attention in every layer
    causal_in_block: bool = False  # bidirectional inside a block, as DFlash trains
    max_anchors: int = 1024  # per packed sequence
    loss_weighting: str = "dpace"  # dpace | exp_decay (speculators' "fixed-exp-decay") | uniform
    loss: str = "ce"  # ce: to the target's greedy token (speculators) | kl: to its whole distribution
    dpace_alpha: float = 0.5
    decay_gamma: float = 4.0  # exp_decay: draft slot j (0-based) weighs exp(-j / gamma)
    mask_token: str = "<|mask|>"  # its embedding comes from the target
    attention_impl: str = "auto"  # auto (CUDA: compiled flex; CPU: chunked SDPA) | flex | chunked | reference
    init_from_target: bool = True  # decoder layers start as the target's top layers (specdistill/drafters/target_init.py)
    init_from: str | None = None  # an export to start from (specdistill/drafters/warm_start.py); its architecture is used


def spread_layer_ids(num_hidden_layers: int, n: int) -> list[int]:
    """n layer ids (vLLM convention) spread over depth, z-lab style: from layer 2 to L-2 where it fits."""
    lo, hi = (2, num_hidden_layers - 2) if num_hidden_layers - 3 >= n else (1, num_hidden_layers - 1)
    n = min(n, hi - lo + 1)
    if n == 1:
        return [hi]
    return sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)})


def dpace_weights(ce_NK: torch.Tensor, valid_NK: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights: suffix sums of the smoothed confidence's prefix products."""
    with torch.no_grad():
        smooth = torch.where(valid_NK, (1.0 - alpha) * torch.exp(-ce_NK.float()) + alpha, torch.ones_like(ce_NK))
        prefix = torch.cumprod(smooth, dim=-1) * valid_NK
        return prefix.flip(-1).cumsum(-1).flip(-1) * valid_NK


LOSS_WEIGHTINGS = ("dpace", "exp_decay", "uniform")


def exp_decay_weights(valid_NK: torch.Tensor, gamma: float) -> torch.Tensor:
    """speculators' fixed-exp-decay: draft slot j = 0..K-1 weighs exp(-j / gamma), zero where not valid."""
    j_K = torch.arange(valid_NK.shape[1], device=valid_NK.device, dtype=torch.float32)
    return torch.exp(-j_K / gamma) * valid_NK


def position_weights(cfg: DFlashConfig, loss_NK: torch.Tensor, valid_NK: torch.Tensor) -> torch.Tensor:
    """Per-slot loss weights [N, K] (detached), zero where not valid.

    dpace: D-PACE on the per-slot loss; exp_decay: speculators' fixed-exp-decay, exp(-j / gamma) for draft
    slot j = 0..K-1 (their slot 1.. with sample_from_anchor=False, slot 0.. with True); uniform: 1.
    """
    if cfg.loss_weighting == "dpace":
        return dpace_weights(loss_NK, valid_NK, cfg.dpace_alpha)
    if cfg.loss_weighting == "exp_decay":
        return exp_decay_weights(valid_NK, cfg.decay_gamma)
    if cfg.loss_weighting == "uniform":
        return valid_NK.float()
    raise ValueError(f"drafter.loss_weighting={cfg.loss_weighting!r} is not one of {LOSS_WEIGHTINGS}")


def window_context(document_ids_T: torch.Tensor, anchors_N: torch.Tensor,
                   sliding_window: int | None) -> torch.Tensor | None:
    """The context positions [C] the blocks of `anchors_N` can read, ascending; None when that is every position.

    The block at anchor a sees [max(doc_start, a - W), a) (kernels/attention/reference.py). Per document with an
    anchor the contiguous range [its first window's start, its last anchor] is kept: the last anchor itself so that
    every anchor has an index among the kept positions, the gaps between windows so that distances inside a document
    (masks, windows) stay those of the pack. Documents that are not contiguous runs, or no anchor: None."""
    T = document_ids_T.shape[0]
    if anchors_N.numel() == 0 or not documents_are_contiguous(document_ids_T):
        return None
    lo_N = document_starts(document_ids_T)[anchors_N]
    if sliding_window is not None:
        lo_N = torch.maximum(lo_N, anchors_N - sliding_window)
    docs_N = document_ids_T[anchors_N]
    # Per document id: [first window start, last anchor + 1); a document with no anchor keeps the empty [T, T).
    lo_D = torch.full_like(document_ids_T, T).scatter_reduce(0, docs_N, lo_N, "amin")
    end_D = torch.full_like(document_ids_T, T).scatter_reduce(0, docs_N, anchors_N + 1, "amax", include_self=False)
    ones = torch.ones_like(lo_D)
    edges = torch.zeros(T + 1, dtype=torch.long, device=document_ids_T.device).index_add_(0, lo_D, ones)
    kept_C = torch.nonzero(edges.index_add_(0, end_D, -ones).cumsum(0)[:T] > 0).squeeze(-1)
    return None if kept_C.numel() == T else kept_C


@dataclass
class BlockContext:
    """The context of one pass of anchor blocks: the pack positions whose fc and K/V it computes (kept_C; None: all),
    their document and position ids (RoPE), and the anchors as indices into them."""

    kept_C: torch.Tensor | None
    document_ids_C: torch.Tensor
    position_ids_C: torch.Tensor
    anchors_N: torch.Tensor

    @classmethod
    def of(cls, batch: PackedBatch, anchors_N: torch.Tensor, sliding_window: int | None, read: bool) -> "BlockContext":
        """read (compute='read'): only the positions some window reaches (window_context); else the whole pack."""
        kept_C = window_context(batch.document_ids_T, anchors_N, sliding_window) if read else None
        if kept_C is None:
            return cls(None, batch.document_ids_T, batch.position_ids_T, anchors_N)
        return cls(kept_C, batch.document_ids_T[kept_C], batch.position_ids_T[kept_C],
                   torch.searchsorted(kept_C, anchors_N))

    def plan(self, block_size: int, sliding_window, causal_in_block: bool, impl: str, static):
        """One attention plan (mask or chunking) per pass, shared by every layer: keys [context ; blocks]."""
        documents_C, C = self.document_ids_C, self.document_ids_C.shape[0]
        padded = self.kept_C is not None and static is not None and static.pad
        if padded:
            # Compiled attention must see few shapes (core/shapes.py): the compacted context is laid out over the
            # run's token budget, as every pack is, so the kernel sees exactly compute='all''s shapes and compiles
            # nothing new. It costs little: fc and K/V are still projected at the kept positions only (the padding's
            # keys are zeros inserted after them, PaddedContext), and flex attention skips the padding's tiles, empty
            # in every block's mask; a finer bucket would only shrink the block mask, at the price of more shapes.
            if C > static.tokens:
                raise ValueError(f"an anchor-block context of {C} positions, more than the run's fixed {static.tokens}"
                                 " (trainer.token_budget)")
            documents_C = pad_documents(documents_C, static.tokens)
        plan = anchor_block_plan(documents_C, self.anchors_N, block_size, sliding_window, causal_in_block, impl=impl,
                                 static=static)
        return PaddedContext(plan, C, static.tokens) if padded else plan


class DFlashAttention(QKVProjections):
    def forward(self, x_QD, ctx_TD, rope_q, rope_k, attention) -> torch.Tensor:
        q = apply_rotary(self.queries(x_QD), *rope_q)
        k, v = self.keys_values(torch.cat([ctx_TD, x_QD]))
        k = apply_rotary(k, *rope_k)
        out = attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), self.scale)
        return self.o_proj(out.reshape(x_QD.shape[0], -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, shape: LayerShape):
        super().__init__()
        hidden, intermediate, eps = shape.hidden, shape.intermediate, shape.eps
        self.self_attn = DFlashAttention(hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim, eps)
        self.mlp = SwiGLU(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x_QD, ctx_TD, rope_q, rope_k, attention) -> torch.Tensor:
        # The context is already normed (hidden_norm) and skips input_layernorm, as in speculators/vLLM.
        x_QD = x_QD + self.self_attn(self.input_layernorm(x_QD), ctx_TD, rope_q, rope_k, attention)
        return x_QD + self.mlp(self.post_attention_layernorm(x_QD))


class DFlashDrafter(Drafter):
    name = "dflash"
    speculators_model_type = "dflash"
    architecture = "DFlashDraftModel"

    def __init__(self, cfg: DFlashConfig, target: TargetInfo, mask_token_id: int):
        super().__init__()
        self.cfg, self.target, self.mask_token_id = cfg, target, mask_token_id
        self.block_size = cfg.block_size
        self.target_layer_ids = list(cfg.target_layer_ids or spread_layer_ids(target.num_hidden_layers, cfg.num_target_layers))
        FeatureSpec(tuple(self.target_layer_ids)).check_against(target.num_hidden_layers)
        D = target.hidden_size
        self.shape = LayerShape.of(cfg, target)
        num_layers, self.served_attention = served_layers(cfg, target, self.shape)
        self.rope_theta = cfg.rope_theta or target.rope_theta
        self.fc = nn.Linear(len(self.target_layer_ids) * D, D, bias=False)
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(num_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.rotary = Rotary(self.shape.head_dim, self.rope_theta)
        self.apply(init_linear)
        if cfg.init_from_target:
            init_layers_from_target(self.layers, target)

    @classmethod
    def build(cls, cfg: DFlashConfig, target: TargetInfo, tokenizer) -> "DFlashDrafter":
        if cfg.init_from:  # the export's mask id (its weights were trained with it); its weights replace any init
            from specdistill.drafters.warm_start import export_config

            config = export_config(cfg.init_from)
            mask = config["mask_token_id"] if "speculators_config" in config else config["dflash_config"]["mask_token_id"]
            return cls(replace(cfg, init_from_target=False), target, int(mask))
        mask_token_id, why = choose_mask_token(tokenizer, target.vocab_size, cfg.mask_token, "drafter.mask_token")
        if not why.startswith("drafter.mask_token"):
            log.warning("drafter.mask_token=%r is not a token of the target's tokenizer: the draft slots use id %d, "
                        "%s (config.json mask_token_id of the export)", cfg.mask_token, mask_token_id, why)
        return cls(cfg, target, mask_token_id)

    @classmethod
    def architecture_from_export(cls, config: dict) -> dict:
        """Our speculators-format exports, or the layout of the DFlash authors' published drafters (a Qwen3 config
        with `dflash_config`: vLLM serves both as method=dflash; docs/warm_start.md)."""
        if "speculators_config" in config:
            layer = config["transformer_layer_config"]
            ids = list(config["aux_hidden_state_layer_ids"])
            causal = not config.get("sliding_window_non_causal", True)
        else:
            layer, dflash = config, config.get("dflash_config") or {}
            if "target_layer_ids" not in dflash or "block_size" not in config:
                raise ValueError("drafter.init_from: config.json is neither a speculators-format DFlash export nor a "
                                 "published DFlash drafter (block_size and dflash_config.target_layer_ids)")
            # Published ids name the output of decoder layer j (0-based); ours and vLLM's count layers run: j + 1.
            ids = [j + 1 for j in dflash["target_layer_ids"]]
            causal = bool(dflash.get("causal", False))
        sliding = "sliding_attention" in (layer.get("layer_types") or [])
        return {"num_layers": layer["num_hidden_layers"], "block_size": config["block_size"], "target_layer_ids": ids,
                "num_target_layers": len(ids), "sliding_window": layer.get("sliding_window") if sliding else None,
                "causal_in_block": causal, **layer_geometry(layer)}

    def load_export(self, path: Path) -> None:
        """A published drafter may carry the target's embeddings and lm_head; this drafter uses the target's own."""
        from specdistill.drafters.warm_start import load_weights

        load_weights(self, path, ignored=frozenset({"embed_tokens.weight", "lm_head.weight"}))

    def make_layer(self, layer_idx: int) -> nn.Module:
        """Variants (DSpark, DFlash 2) override this to wrap the shared layer."""
        return DFlashDecoderLayer(self.shape)

    @property
    def num_speculative_tokens(self) -> int:
        return self.block_size - 1

    def feature_spec(self) -> FeatureSpec:
        """The context layers from the first anchor (the row's first response token) minus the window, which is as
        far back as any block's keys reach (kernels/attention/reference.py); the last layer (pre-norm: the target's
        own distribution, computed by the trainer) where a label's distribution is read, unless it is an input."""
        return reads(self.target_layer_ids, self.target.num_hidden_layers, self.cfg.sliding_window)

    # --- forward -----------------------------------------------------------------------------------
    def block_hidden(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        """Final-normed drafter states [N, B, D] for one block per anchor, all blocks in one pass."""
        N, B = anchors_N.shape[0], self.block_size
        context = BlockContext.of(batch, anchors_N, self.cfg.sliding_window, read=self.compute == "read")
        ctx_CD = self.hidden_norm(self.fc(self.context_states(batch, context.kept_C)))
        block_ids_NB = torch.full((N, B), self.mask_token_id, dtype=torch.long, device=anchors_N.device)
        block_ids_NB[:, 0] = batch.input_ids_T[anchors_N]
        x_QD = head.embed_tokens(block_ids_NB.flatten()).to(ctx_CD.dtype)
        block_pos_Q = (batch.position_ids_T[anchors_N][:, None] + torch.arange(B, device=anchors_N.device)).flatten()
        rope_q = self.rotary(block_pos_Q)
        rope_k = self.rotary(torch.cat([context.position_ids_C, block_pos_Q]))
        attention = context.plan(B, self.cfg.sliding_window, self.cfg.causal_in_block, self.cfg.attention_impl,
                                 batch.static)
        for layer in self.layers:
            x_QD = layer(x_QD, ctx_CD, rope_q, rope_k, attention)
        return self.norm(x_QD).view(N, B, -1)

    def context_states(self, batch: PackedBatch, positions_C: torch.Tensor | None) -> torch.Tensor:
        """The fused input [C, L * D] of `fc`: the target layers' states at the context positions (None: all)."""
        states_TLD = batch.layers(self.target_layer_ids)
        return (states_TLD if positions_C is None else states_TLD[positions_C]).flatten(1)

    def last_layer_at(self, batch: PackedBatch, positions_P: torch.Tensor) -> torch.Tensor:
        """The target's last-layer states [P, D] at pack positions (pre-norm): its distribution there."""
        return batch.layer_at(self.target.num_hidden_layers, positions_P)

    def label_positions(self, batch: PackedBatch, anchors_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token positions [N, K] each draft slot predicts, and which of them carry loss."""
        T = batch.num_tokens
        pos_NK = anchors_N[:, None] + torch.arange(1, self.block_size, device=anchors_N.device)
        clamped = pos_NK.clamp(max=T - 1)
        valid = (pos_NK < T) & batch.loss_mask_T[clamped]
        valid &= batch.document_ids_T[clamped] == batch.document_ids_T[anchors_N][:, None]
        return clamped, valid

    def select_anchors(self, batch: PackedBatch, generator: torch.Generator) -> torch.Tensor:
        """Anchors are response tokens (the first one is what the target emits after the prompt)."""
        return sample_anchors(torch.nonzero(batch.loss_mask_T).squeeze(-1), self.cfg.max_anchors, generator)

    def training_step(self, batch: PackedBatch, head: TargetHead, generator: torch.Generator) -> StepOutput:
        return self.block_loss(batch, head, self.select_anchors(batch, generator))

    def block_loss(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> StepOutput:
        """Loss and metrics of one block per anchor (the anchors chosen by the caller, so a reference
        implementation can be compared on the same blocks)."""
        pos_NK, valid_NK = self.label_positions(batch, anchors_N)
        if self.cfg.loss not in ("ce", "kl"):
            raise ValueError(f"drafter.loss={self.cfg.loss!r}; valid: ce, kl")
        # Response-only target logits: the target's token at p comes from its state at p-1. A position is the
        # label of up to K blocks: its greedy token (ce) or its logits (kl, compute='read') are formed once.
        target = DistinctTargets(head, lambda p: self.last_layer_at(batch, p), pos_NK[valid_NK] - 1,
                                 keep_logits=self.cfg.loss == "kl" and self.compute == "read")
        hidden_MD = self.block_hidden(batch, head, anchors_N)[:, 1:][valid_NK]
        # Draft logits only at loss positions, a chunk at a time (never [M, vocab] for backward); the greedy
        # tokens for the metrics come from the same pass.
        W = head.lm_head.weight
        if self.cfg.loss == "kl":
            rows = chunked_loss("kl", hidden_MD, W, **target.loss_args())
            target_M = rows.target_token
        else:
            target_M = target.argmax_U[target.rows_M]
            rows = chunked_loss("ce", hidden_MD, W, labels_M=target_M)
        loss_NK = torch.zeros(valid_NK.shape, device=rows.loss.device).masked_scatter(valid_NK, rows.loss)
        weight_NK = position_weights(self.cfg, loss_NK, valid_NK)
        loss = (weight_NK * loss_NK).sum() / valid_NK.sum().clamp(min=1)
        correct_NK = torch.zeros_like(valid_NK).masked_scatter(valid_NK, rows.draft_token == target_M)
        return block_metrics(loss, correct_NK, valid_NK)

    @torch.no_grad()
    def propose(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        hidden_NKD = self.block_hidden(batch, head, anchors_N)[:, 1:]
        return chunked_argmax(hidden_NKD.flatten(0, 1), head.lm_head.weight).view(hidden_NKD.shape[:2])

    def draft_logits(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        return head.lm_head(self.block_hidden(batch, head, anchors_N)[:, 1:])

    # --- export ------------------------------------------------------------------------------------
    def speculators_config(self, target: TargetInfo) -> dict:
        cfg, n = self.cfg, len(self.layers)
        sliding = self.served_attention == "sliding"
        layer_type = "sliding_attention" if sliding else "full_attention"
        return {
            "architectures": [self.architecture],
            "speculators_model_type": self.speculators_model_type,
            "speculators_version": "0.9.0",
            "transformer_layer_config": {
                **speculators_layer_config(self.shape, target, n, self.rope_theta, layer_type),
                "sliding_window": cfg.sliding_window if sliding else None,
                "max_window_layers": 0,
            },
            "draft_vocab_size": target.vocab_size,
            "target_hidden_size": target.hidden_size,
            "block_size": self.block_size,
            "aux_hidden_state_layer_ids": self.target_layer_ids,
            "mask_token_id": self.mask_token_id,
            # vLLM 0.32 serves `causal = not sliding_window_non_causal`: write the training mask explicitly.
            "sliding_window_non_causal": not cfg.causal_in_block,
            "sample_from_anchor": False,
            "tie_word_embeddings": False,
            "dtype": target.torch_dtype,
            "speculators_config": speculators_block(self.speculators_model_type, self.num_speculative_tokens, target),
        }

    def export(self, out_dir: Path, target: TargetInfo) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        dtype = export_dtype(target)
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        (out_dir / "config.json").write_text(json.dumps(self.speculators_config(target), indent=2) + "\n")


DEFAULT_NUM_LAYERS = 5  # the field report's DFlash


def served_layers(cfg: DFlashConfig, target: TargetInfo, shape: LayerShape) -> tuple[int, str]:
    """(number of layers, "sliding" | "full"): the drafter vLLM 0.32 can serve next to this target.

    Its layers must share one KV-cache group (specdistill/drafters/vllm_groups.py). Sliding-window layers are exported as
    trained when they do; otherwise as full attention, which computes the same for contexts up to the window
    (training rows longer than the window are the only difference); a window as long as the target's context is
    full attention anyway. num_layers=None takes DEFAULT_NUM_LAYERS, or
    the most vLLM can group; an explicit count that vLLM cannot group fails here, before any training."""
    target_specs = vllm_groups.target_specs(target.layer_types, target.num_key_value_heads, target.head_dim,
                                            getattr(target, "sliding_window", None))
    full = vllm_groups.attention_spec("full", shape.num_kv_heads, shape.head_dim)
    # A window that covers the target's whole context is full attention: export it as such (one KV-cache group
    # with any full-attention target).
    windowed = cfg.sliding_window is not None and cfg.sliding_window < target.max_position_embeddings
    kinds = ([("sliding", vllm_groups.attention_spec("sliding", shape.num_kv_heads, shape.head_dim,
                                                     cfg.sliding_window))] if windowed else [])
    kinds.append(("full", full))
    n = cfg.num_layers or DEFAULT_NUM_LAYERS
    for kind, spec in kinds:
        if vllm_groups.drafter_in_one_group(target_specs, [spec] * n):
            if kind == "full" and windowed:
                log.warning("DFlash: vLLM cannot place %d sliding-window layers next to this target in one KV-cache "
                            "group; the export serves them as full attention, identical for contexts up to "
                            "drafter.sliding_window=%d tokens (docs/vllm.md)", n, cfg.sliding_window)
            return n, kind
    most = vllm_groups.max_layers_in_one_group(target_specs, full)
    if cfg.num_layers is None:
        log.warning("DFlash: %d layers cannot share one vLLM KV-cache group next to this target (%s); using %d "
                    "full-attention layers (docs/vllm.md)", n, _layer_summary(target), most)
        return most, "full"
    raise ValueError(f"drafter.num_layers={n}: vLLM 0.32 cannot serve {n} DFlash layers next to this target "
                     f"({_layer_summary(target)}): they would not share one KV-cache group (docs/vllm.md, \"KV-cache "
                     f"groups\"); set drafter.num_layers <= {most}, or leave it unset to pick that")


def _layer_summary(target: TargetInfo) -> str:
    counts = {t: target.layer_types.count(t) for t in dict.fromkeys(target.layer_types)}
    return ", ".join(f"{n} {t}" for t, n in counts.items())
