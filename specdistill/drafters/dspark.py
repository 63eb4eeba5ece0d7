"""DSpark: the DFlash backbone + a Markov logit-bias head + a confidence head (speculators 0.9.0 `dspark`).

The backbone drafts a block in one parallel pass (specdistill/drafters/dflash.py). The Markov head then makes slot k depend
on the token chosen at the previous position: logits_k = lm_head(h_k) + W2 f_k, f_k a rank-r feature of that
token (vanilla: f = W1[prev]; gated: sigmoid(gate([h; W1[prev]])) * W1[prev]; rnn: a recurrent state over the
block). The confidence head predicts each slot's acceptance probability, sigmoid(proj([h; W1[prev]])), trained
by BCE toward 1 - TV(p_draft, p_target) (the analytic acceptance rate of lossless verification).

sample_from_anchor=True (speculators' DSpark default, DeepSpec convention): every block slot drafts. Slot k sits
at position p+k (slot 0 = the anchor token, the last verified one; slots 1.. = mask) and predicts token p+k+1,
so K = B; its Markov input is the token at p+k (the anchor for slot 0). Loss rows follow speculators: slot k
counts where position p+k is a response token (same document), and its target is the target's distribution
from its state at p+k. With sample_from_anchor=False the layout is DFlash's (slot 0 = anchor, K = B-1).

Loss (speculators' compute_metrics): sum_j w_j KL(p_target || p_draft) / #rows + alpha * sum_j d_j BCE / #rows,
w = drafter.loss_weighting (speculators' default fixed-exp-decay exp(-j/4)), d = exp decay always (D-PACE
expects a token CE). Teacher-forced: the Markov inputs are the data tokens, the target's own continuation.
propose(): greedy, slot by slot through the Markov bias from the anchor, as vLLM's DSparkSpeculator samples.

The Markov-corrected logits are [h; f] @ [W_lm; W2]^T, so the chunked response-only kernels (specdistill/kernels/logits)
compute them without a [rows, vocab] tensor, the bias included.
Suffixes: T packed tokens, N anchors, B block, K draft slots, M loss rows, D hidden, r Markov rank, V vocab.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdistill.core.batch import PackedBatch
from specdistill.core.target import TargetHead, TargetInfo
from specdistill.drafters.base import block_metrics
from specdistill.drafters.dflash import DFlashConfig, DFlashDrafter, exp_decay_weights, position_weights
from specdistill.drafters.layers import init_linear
from specdistill.drafters.targets import DistinctTargets
from specdistill.kernels.logits import chunked_argmax, chunked_loss

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass
class DSparkConfig(DFlashConfig):
    """speculators 0.9.0 DSpark defaults on top of DFlash's (block 8 and the rest inherited)."""

    name: str = "dspark"
    loss_weighting: str = "exp_decay"  # speculators' per_position_loss_weight default, gamma = decay_gamma
    sample_from_anchor: bool = True  # slot 0 drafts too: K = block_size
    markov_rank: int = 256  # 0 disables the Markov head (pure DFlash drafting)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn (vLLM 0.32 serves vanilla only)
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True  # confidence input [h; W1[prev]]
    confidence_alpha: float = 1.0  # weight of the confidence BCE


class MarkovHead(nn.Module):
    """Low-rank bias W2 f(prev token) over the vocabulary; names as speculators' / vLLM's `markov_head`."""

    def __init__(self, vocab_size: int, rank: int, hidden: int, head_type: str):
        super().__init__()
        if head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"drafter.markov_head_type={head_type!r} is not one of {MARKOV_HEAD_TYPES}")
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)  # [gate; candidate; output]

    def step(self, prev_N, hidden_ND, state_Nr):
        """One block slot: (feature f [N, r], embedding W1[prev] [N, r], next recurrent state)."""
        emb = self.markov_w1(prev_N)
        if self.head_type == "vanilla":
            return emb, emb, state_Nr
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden_ND.to(emb.dtype), emb], -1))) * emb, emb, state_Nr
        state_Nr = emb.new_zeros(emb.shape) if state_Nr is None else state_Nr
        gate, cand, out = self.joint_proj(torch.cat([state_Nr, emb, hidden_ND.to(emb.dtype)], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), emb, gate * state_Nr + (1.0 - gate) * torch.tanh(cand)

    def features(self, prev_NB, hidden_NBD):
        """Teacher-forced features and embeddings [N, B, r] for every slot of each block."""
        if self.head_type != "rnn":  # no recurrence: all slots at once
            feat, emb, _ = self.step(prev_NB, hidden_NBD, None)
            return feat, emb
        state, feats, embs = None, [], []
        for k in range(prev_NB.shape[1]):
            feat, emb, state = self.step(prev_NB[:, k], hidden_NBD[:, k], state)
            feats.append(feat)
            embs.append(emb)
        return torch.stack(feats, 1), torch.stack(embs, 1)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)  # logit of the acceptance probability


class DSparkDrafter(DFlashDrafter):
    name = "dspark"
    speculators_model_type = "dspark"
    architecture = "Qwen3DSparkModel"  # what vLLM instantiates (speculators' own default name is DSparkSpeculator)

    def __init__(self, cfg: DSparkConfig, target: TargetInfo, mask_token_id: int):
        super().__init__(cfg, target, mask_token_id)
        D, r = target.hidden_size, cfg.markov_rank
        self.first_slot = 0 if cfg.sample_from_anchor else 1
        self.markov_head = MarkovHead(target.vocab_size, r, D, cfg.markov_head_type) if r > 0 else None
        self.confidence_head = None
        if cfg.enable_confidence_head:
            if cfg.confidence_head_with_markov and self.markov_head is None:
                raise ValueError("drafter.confidence_head_with_markov=true needs drafter.markov_rank > 0")
            self.confidence_head = ConfidenceHead(D + (r if cfg.confidence_head_with_markov else 0))
        for module in (self.markov_head, self.confidence_head):
            if module is not None:
                module.apply(init_linear)
        if self.markov_head is not None:
            nn.init.normal_(self.markov_head.markov_w1.weight, std=0.01)  # speculators' init

    @property
    def num_speculative_tokens(self) -> int:
        return self.block_size - self.first_slot

    def adamw_matrices(self) -> list[nn.Parameter]:
        """+ the Markov head's vocabulary projection and the confidence head's one-logit projection (its token
        table markov_w1 is an nn.Embedding, in the default)."""
        heads = [self.markov_head.markov_w2.weight] if self.markov_head is not None else []
        if self.confidence_head is not None:
            heads.append(self.confidence_head.proj.weight)
        return [*super().adamw_matrices(), *heads]

    # --- heads ------------------------------------------------------------------------------------
    def draft_rows(self, batch: PackedBatch, anchors_N: torch.Tensor):
        """Per draft slot [N, K]: which rows carry loss, the target state each learns, and the Markov input
        tokens of all B slots [N, B] (teacher-forced: the data tokens)."""
        T, B = batch.num_tokens, self.block_size
        at_NB = anchors_N[:, None] + torch.arange(B, device=anchors_N.device)  # position of each block slot
        clamped_NB = at_NB.clamp(max=T - 1)
        tokens_NB = batch.input_ids_T[clamped_NB]
        # Slot k's previous token: the one at p+k (sample_from_anchor) or at p+k-1 (slot 0 and 1: the anchor).
        prev_NB = tokens_NB if self.cfg.sample_from_anchor else torch.cat([tokens_NB[:, :1], tokens_NB[:, :-1]], 1)
        at_NK, clamped_NK = at_NB[:, self.first_slot:], clamped_NB[:, self.first_slot:]
        valid_NK = (at_NK < T) & batch.loss_mask_T[clamped_NK]
        valid_NK &= batch.document_ids_T[clamped_NK] == batch.document_ids_T[anchors_N][:, None]
        state_NK = clamped_NK if self.cfg.sample_from_anchor else (clamped_NK - 1).clamp(min=0)
        return valid_NK, state_NK, prev_NB

    def corrected(self, hidden_NBD, prev_NB, head: TargetHead):
        """Inputs and weight of the Markov-corrected logits ([h; f] @ [W_lm; W2]^T), and the confidence logits."""
        W = head.lm_head.weight
        if self.markov_head is None:
            x_NBD, emb = hidden_NBD, None
        else:
            feat, emb = self.markov_head.features(prev_NB, hidden_NBD)
            x_NBD = torch.cat([hidden_NBD, feat.to(hidden_NBD.dtype)], -1)
            W = torch.cat([W, self.markov_head.markov_w2.weight.to(W.dtype)], 1)
        conf_NB = None
        if self.confidence_head is not None:
            with_markov = self.cfg.confidence_head_with_markov
            conf_NB = self.confidence_head(torch.cat([hidden_NBD, emb.to(hidden_NBD.dtype)], -1) if with_markov
                                           else hidden_NBD)
        return x_NBD, W, conf_NB

    def block_logits(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor):
        """Teacher-forced Markov-corrected logits [N, B, V] and confidence logits [N, B] (tests, small N)."""
        _, _, prev_NB = self.draft_rows(batch, anchors_N)
        x_NBD, W, conf_NB = self.corrected(self.block_hidden(batch, head, anchors_N), prev_NB, head)
        return F.linear(x_NBD, W), conf_NB

    # --- training ---------------------------------------------------------------------------------
    def training_step(self, batch: PackedBatch, head: TargetHead, generator: torch.Generator):
        return self.block_loss(batch, head, self.select_anchors(batch, generator))

    def block_loss(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor):
        valid_NK, state_NK, prev_NB = self.draft_rows(batch, anchors_N)
        x_NBD, W, conf_NB = self.corrected(self.block_hidden(batch, head, anchors_N), prev_NB, head)
        x_MD = x_NBD[:, self.first_slot:][valid_NK]
        # The target's logits over its whole vocabulary, once per distinct state (a position is a slot of up to K
        # blocks) with compute='read'; 'all' forms them per row, in each chunk, forward and backward.
        target = DistinctTargets(head, lambda p: self.last_layer_at(batch, p), state_NK[valid_NK],
                                 keep_logits=self.compute == "read")
        # One chunked pass: the KL, and from its logits the greedy tokens and TV (the confidence head's label).
        pass_M = chunked_loss("kl", x_MD, W, with_tv=True, **target.loss_args())
        kl_M = pass_M.loss
        kl_NK = torch.zeros(valid_NK.shape, device=kl_M.device).masked_scatter(valid_NK, kl_M)
        rows = valid_NK.sum().clamp(min=1)
        kl_loss = (position_weights(self.cfg, kl_NK, valid_NK) * kl_NK).sum() / rows
        loss, extra = kl_loss, {"kl_loss": float(kl_loss.detach())}
        accept_M = 1.0 - pass_M.tv  # = sum_v min(p, q), with the draft detached
        if conf_NB is not None:
            conf_M = conf_NB[:, self.first_slot:][valid_NK]
            bce_M = F.binary_cross_entropy_with_logits(conf_M.float(), accept_M, reduction="none")
            bce_NK = torch.zeros(valid_NK.shape, device=bce_M.device).masked_scatter(valid_NK, bce_M)
            conf_loss = (exp_decay_weights(valid_NK, self.cfg.decay_gamma) * bce_NK).sum() / rows
            loss = loss + self.cfg.confidence_alpha * conf_loss
            extra |= {"confidence_loss": float(conf_loss.detach()),
                      "confidence_abs_error": float((conf_M.detach().float().sigmoid() - accept_M).abs().mean())}
        correct_NK = torch.zeros_like(valid_NK).masked_scatter(valid_NK, pass_M.draft_token == pass_M.target_token)
        out = block_metrics(loss, correct_NK, valid_NK)
        out.extra = extra | {"accept_rate": float(accept_M.mean()) if accept_M.numel() else 0.0}
        return out

    # --- serving ----------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        """Greedy, slot by slot: each slot's Markov bias comes from the token chosen at the slot before."""
        hidden_NBD = self.block_hidden(batch, head, anchors_N)
        if self.markov_head is None:
            return chunked_argmax(hidden_NBD[:, self.first_slot:].flatten(0, 1), head.lm_head.weight).view(
                anchors_N.shape[0], -1)
        W = torch.cat([head.lm_head.weight, self.markov_head.markov_w2.weight.to(head.lm_head.weight.dtype)], 1)
        prev_N, state, drafts = batch.input_ids_T[anchors_N], None, []
        for k in range(self.block_size):  # slot 0 runs even when it does not draft: the rnn state starts there
            feat, _, state = self.markov_head.step(prev_N, hidden_NBD[:, k], state)
            if k >= self.first_slot:
                prev_N = chunked_argmax(torch.cat([hidden_NBD[:, k], feat.to(hidden_NBD.dtype)], -1), W)
                drafts.append(prev_N)
        return torch.stack(drafts, 1)

    def draft_logits(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        return self.block_logits(batch, head, anchors_N)[0][:, self.first_slot:]

    # --- export -----------------------------------------------------------------------------------
    @classmethod
    def architecture_from_export(cls, config: dict) -> dict:
        extra = ("sample_from_anchor", "markov_rank", "markov_head_type", "enable_confidence_head",
                      "confidence_head_with_markov")
        return {**super().architecture_from_export(config), **{k: config[k] for k in extra}}

    def speculators_config(self, target: TargetInfo) -> dict:
        config = super().speculators_config(target)
        cfg = self.cfg
        config.update(sample_from_anchor=cfg.sample_from_anchor, markov_rank=cfg.markov_rank,
                      markov_head_type=cfg.markov_head_type, enable_confidence_head=cfg.enable_confidence_head,
                      confidence_head_with_markov=cfg.confidence_head_with_markov)
        return config
