"""DFlash 2: the DFlash backbone + local dynamic convolutions + a candidate selector (speculators 0.9.0 `dflash2`).

Convolution: every layer wraps attention and MLP in a grouped dynamic causal convolution (kernel 2): for block
slot i, y_i = sum_t x_{i-t} * (base_t + delta_{i,t}), base_t per channel, delta_{i,t} per group of
`conv_group_size` channels, projected from the sublayer's (normed) input at slot i. The input side convolves the
sublayer input, the output side its output with the second half of the same projection. Taps never reach across
a block (t <= slot index), and base = [1, 0], projection = 0 makes both an identity at init (= DFlash).

Selector: the unary (lm_head) top-16 candidates per slot are re-scored by
s(prev, c) = z_c + <C_pred[prev] * P h, C_succ[c]> (rank 256), prev = the token chosen at the slot before
(the verified anchor for the first draft slot). Serving walks greedily from the anchor: at each slot the best
candidate given the previous choice (vLLM's DFlash2Speculator, temperature 0). Training is teacher-forced (prev
= the data token) and adds the selector's CE over the 16 candidates, the target's greedy token inserted in place
of the weakest candidate when unary top-16 misses it.

Loss (speculators' compute_metrics): sum_j w_j KL(p_target || q) / #rows + alpha * sum_j w'_j CE_sel / #rows,
w from drafter.loss_weighting (speculators' default fixed-exp-decay exp(-j/4); D-PACE uses each term's own loss).
Layout is DFlash's (sample_from_anchor=False): slot 0 = anchor, K = B-1. Needs the full target vocabulary.
Suffixes: T packed tokens, N anchors, B block, K draft slots, M loss rows, C candidates, D hidden, G groups.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdistill.core.batch import PackedBatch
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.drafters.base import block_metrics
from specdistill.drafters.dflash import DFlashConfig, DFlashDecoderLayer, DFlashDrafter, position_weights
from specdistill.drafters.layers import LayerShape, init_linear
from specdistill.drafters.targets import DistinctTargets
from specdistill.kernels.logits import DEFAULT_CHUNK, chunked_argmax, chunked_loss


@dataclass
class DFlash2Config(DFlashConfig):
    """speculators 0.9.0 DFlash2 defaults on top of DFlash's (bidirectional blocks, block 8 inherited)."""

    name: str = "dflash2"
    loss_weighting: str = "exp_decay"  # speculators' per_position_loss_weight default, gamma = decay_gamma
    conv_kernel_size: int = 2  # causal taps inside a block
    conv_group_size: int = 16  # channels sharing one dynamic coefficient
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_alpha: float = 1.0  # weight of the selector CE


def grouped_dynamic_conv(x_QD, delta_QtG, base_tD, block_size: int, group_size: int) -> torch.Tensor:
    """y_i = sum_t x_{i-t} (base_t + delta_{i,t}), only for taps t <= slot index i % block_size.

    Q = N*B rows laid out block after block. delta_QtG is per group of `group_size` channels.
    """
    Q, D = x_QD.shape
    taps, G = base_tD.shape[0], D // group_size
    x_QGg = x_QD.view(Q, G, group_size)
    coeff_QtGg = base_tD.to(x_QD.dtype).view(1, taps, G, group_size) + delta_QtG[..., None]
    slot_Q = torch.arange(Q, device=x_QD.device) % block_size
    y = coeff_QtGg[:, 0] * x_QGg
    for t in range(1, taps):
        # roll wraps the first t rows of the pack around, and those rows sit at slots < t: masked.
        y = y + coeff_QtGg[:, t] * torch.roll(x_QGg, t, 0) * (slot_Q >= t).view(-1, 1, 1)
    return y.view(Q, D)


class GroupedDynamicCausalConv(nn.Module):
    """Input- and output-side convolutions from one projection; names as speculators' / vLLM's."""

    def __init__(self, hidden: int, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden % group_size:
            raise ValueError(f"drafter.conv_group_size={group_size} must divide the hidden size {hidden}")
        if kernel_size > block_size:
            raise ValueError(f"drafter.conv_kernel_size={kernel_size} exceeds drafter.block_size={block_size}")
        self.block_size, self.kernel_size, self.group_size = block_size, kernel_size, group_size
        self.num_groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden))  # [input/output side, tap, D]
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity on both sides: tap 0 = 1, later taps 0, no dynamic part."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def prepare(self, x_QD):
        """Convolved sublayer input, and the output-side dynamic kernel [Q, taps, G] for `finish`."""
        delta = self.kernel_projection(x_QD).view(x_QD.shape[0], 2, self.kernel_size, self.num_groups)
        y = grouped_dynamic_conv(x_QD, delta[:, 0], self.base_kernel[0], self.block_size, self.group_size)
        return y, delta[:, 1]

    def finish(self, x_QD, delta_QtG):
        return grouped_dynamic_conv(x_QD, delta_QtG, self.base_kernel[1], self.block_size, self.group_size)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, shape: LayerShape, block_size: int, kernel_size: int, group_size: int):
        super().__init__(shape)
        self.attention_conv = GroupedDynamicCausalConv(shape.hidden, block_size, kernel_size, group_size)
        self.mlp_conv = GroupedDynamicCausalConv(shape.hidden, block_size, kernel_size, group_size)

    def reset_convolutions(self) -> None:
        self.attention_conv.reset_parameters()
        self.mlp_conv.reset_parameters()

    def forward(self, x_QD, ctx_TD, rope_q, rope_k, attention) -> torch.Tensor:
        h, delta = self.attention_conv.prepare(self.input_layernorm(x_QD))
        x_QD = x_QD + self.attention_conv.finish(self.self_attn(h, ctx_TD, rope_q, rope_k, attention), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x_QD))
        return x_QD + self.mlp_conv.finish(self.mlp(h), delta)


class CandidateSelector(nn.Module):
    """Bilinear edge scores between the previous token and a slot's candidates; speculators' names."""

    def __init__(self, vocab_size: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def transition_scores(self, hidden_MD, prev_M, candidates_MC) -> torch.Tensor:
        # F.embedding, not codebook[ids]: on CPU with several threads the backward of indexing accumulates rows that
        # share a token id with atomic adds, in an order that varies run to run (index_put_ with accumulate);
        # embedding's backward sums each row's gradients in a fixed order, so a seed gives the same drafter.
        context_Mr = F.embedding(prev_M, self.predecessor_codebook) * self.hidden_projection(hidden_MD).to(
            self.predecessor_codebook.dtype)
        return (context_Mr[:, None] * F.embedding(candidates_MC, self.successor_codebook)).sum(-1)


def selector_training_candidates(candidates_MC: torch.Tensor, target_M: torch.Tensor):
    """Put the target's token in place of the weakest (last) candidate where top-k misses it.

    Returns (training candidates [M, C], label = index of the target among them [M], whether top-k had it [M]).
    """
    match_MC = candidates_MC == target_M[:, None]
    contains_M = match_MC.any(-1)
    label_M = torch.where(contains_M, match_MC.long().argmax(-1), candidates_MC.shape[-1] - 1)
    training_MC = candidates_MC.clone()
    training_MC[:, -1] = torch.where(contains_M, candidates_MC[:, -1], target_M)
    return training_MC, label_M, contains_M


@torch.no_grad()
def chunked_topk(hidden_MD, weight_VD, k: int, chunk: int = DEFAULT_CHUNK):
    """Top-k (values, ids) of hidden W^T, a chunk of logits at a time."""
    parts = [F.linear(hidden_MD[c0:c0 + chunk], weight_VD).float().topk(k, -1)
             for c0 in range(0, hidden_MD.shape[0], chunk)]
    if not parts:
        return hidden_MD.new_zeros(0, k, dtype=torch.float32), hidden_MD.new_zeros(0, k, dtype=torch.long)
    return torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])


class DFlash2Drafter(DFlashDrafter):
    name = "dflash2"
    speculators_model_type = "dflash2"
    architecture = "DFlash2DraftModel"

    def __init__(self, cfg: DFlash2Config, target: TargetInfo, mask_token_id: int):
        super().__init__(cfg, target, mask_token_id)
        if cfg.selector_top_k > target.vocab_size:
            raise ValueError(f"drafter.selector_top_k={cfg.selector_top_k} exceeds the vocabulary "
                             f"({target.vocab_size})")
        for layer in self.layers:  # the base init drew the projections at random: back to identity
            layer.reset_convolutions()
        self.candidate_selector = CandidateSelector(target.vocab_size, target.hidden_size, cfg.selector_rank,
                                                    cfg.selector_top_k)
        self.candidate_selector.apply(init_linear)

    def make_layer(self, layer_idx: int) -> nn.Module:
        cfg = self.cfg
        return DFlash2DecoderLayer(self.shape, self.block_size, cfg.conv_kernel_size, cfg.conv_group_size)

    # --- training ---------------------------------------------------------------------------------
    def adamw_matrices(self) -> list[nn.Parameter]:
        """+ the selector's token codebooks and the convolutions' zero-initialised (identity) dynamic projections."""
        selector = self.candidate_selector
        convs = [conv for layer in self.layers for conv in (layer.attention_conv, layer.mlp_conv)]
        return [*super().adamw_matrices(), selector.predecessor_codebook, selector.successor_codebook,
                *(conv.kernel_projection.weight for conv in convs)]

    def training_step(self, batch: PackedBatch, head: TargetHead, generator: torch.Generator):
        return self.block_loss(batch, head, self.select_anchors(batch, generator))

    def selector_scores(self, hidden_MD, prev_M, candidates_MC, head: TargetHead) -> torch.Tensor:
        """Unary logit of each candidate + its edge score from the previous token [M, C]."""
        unary_MC = torch.einsum("md,mcd->mc", hidden_MD, head.lm_head.weight[candidates_MC].to(hidden_MD.dtype))
        return unary_MC.float() + self.candidate_selector.transition_scores(hidden_MD, prev_M, candidates_MC).float()

    def block_loss(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor):
        pos_NK, valid_NK = self.label_positions(batch, anchors_N)
        hidden_MD = self.block_hidden(batch, head, anchors_N)[:, 1:][valid_NK]
        state_M = pos_NK[valid_NK] - 1  # the target's token at p comes from its state at p-1 ...
        prev_M = batch.input_ids_T[state_M]  # ... and follows the token at p-1 (teacher forcing)
        W = head.lm_head.weight
        # The target's logits once per distinct state with compute='read' (a position is a slot of up to K blocks).
        target = DistinctTargets(head, lambda p: self.last_layer_at(batch, p), state_M,
                                 keep_logits=self.compute == "read")
        kl_rows = chunked_loss("kl", hidden_MD, W, **target.loss_args())  # the target's greedy tokens: same pass
        kl_M, target_M = kl_rows.loss, kl_rows.target_token
        _, candidates_MC = chunked_topk(hidden_MD.detach(), W, self.cfg.selector_top_k)
        training_MC, label_M, contains_M = selector_training_candidates(candidates_MC, target_M)
        scores_MC = self.selector_scores(hidden_MD, prev_M, training_MC, head)
        sel_M = F.cross_entropy(scores_MC, label_M, reduction="none")
        rows = valid_NK.sum().clamp(min=1)
        per_row = {}
        for key, value_M in (("kl", kl_M), ("sel", sel_M)):
            value_NK = torch.zeros(valid_NK.shape, device=value_M.device).masked_scatter(valid_NK, value_M)
            per_row[key] = (position_weights(self.cfg, value_NK, valid_NK) * value_NK).sum() / rows
        loss = per_row["kl"] + self.cfg.selector_alpha * per_row["sel"]
        # Accuracy of the selector's choice with a teacher-forced predecessor, counted only where serving's
        # candidate set had the target (as speculators' eal).
        chosen_M = training_MC.gather(1, scores_MC.detach().argmax(-1, keepdim=True))[:, 0]
        correct_NK = torch.zeros_like(valid_NK).masked_scatter(valid_NK, (chosen_M == target_M) & contains_M)
        out = block_metrics(loss, correct_NK, valid_NK)
        out.extra = {"kl_loss": float(per_row["kl"].detach()), "selector_loss": float(per_row["sel"].detach()),
                     "candidate_recall": float(contains_M.float().mean()) if contains_M.numel() else 0.0}
        return out

    # --- serving ----------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        """The selector's greedy walk from the verified anchor (vLLM DFlash2Speculator at temperature 0)."""
        hidden_NKD = self.block_hidden(batch, head, anchors_N)[:, 1:]
        N, K, _ = hidden_NKD.shape
        values_MC, candidates_MC = chunked_topk(hidden_NKD.flatten(0, 1), head.lm_head.weight, self.cfg.selector_top_k)
        values_NKC, candidates_NKC = values_MC.view(N, K, -1), candidates_MC.view(N, K, -1)
        prev_N, drafts = batch.input_ids_T[anchors_N], []
        for k in range(K):
            scores_NC = values_NKC[:, k] + self.candidate_selector.transition_scores(
                hidden_NKD[:, k], prev_N, candidates_NKC[:, k]).float()
            prev_N = candidates_NKC[:, k].gather(1, scores_NC.argmax(-1, keepdim=True))[:, 0]
            drafts.append(prev_N)
        return torch.stack(drafts, 1) if drafts else anchors_N.new_zeros(N, 0)

    def draft_logits(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        """The selector's distribution over each slot's top-k candidates: unary logit + edge score from the
        previous token (the row's); -inf outside the candidates."""
        hidden_NKD = self.block_hidden(batch, head, anchors_N)[:, 1:]
        N, K, _ = hidden_NKD.shape
        values_MC, cand_MC = chunked_topk(hidden_NKD.flatten(0, 1), head.lm_head.weight, self.cfg.selector_top_k)
        # past the row's end the previous token is unknown and its slot never scored: clamp, as MTP and DSpark do
        at_NK = anchors_N[:, None] + torch.arange(K, device=anchors_N.device)
        prev_NK = batch.input_ids_T[at_NK.clamp(max=batch.input_ids_T.shape[0] - 1)]
        scores_MC = values_MC + self.candidate_selector.transition_scores(
            hidden_NKD.flatten(0, 1), prev_NK.flatten(), cand_MC).float()
        out_MV = scores_MC.new_full((N * K, head.lm_head.weight.shape[0]), float("-inf"))
        return out_MV.scatter_(1, cand_MC, scores_MC).view(N, K, -1)

    # --- export -----------------------------------------------------------------------------------
    @classmethod
    def architecture_from_export(cls, config: dict) -> dict:
        extra = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        return {**super().architecture_from_export(config), **{k: config[k] for k in extra}}

    def speculators_config(self, target: TargetInfo) -> dict:
        config = super().speculators_config(target)
        cfg = self.cfg
        config.update(conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
                      selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k)
        return config
