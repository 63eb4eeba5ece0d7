"""EAGLE-3: one decoder layer over [token embedding ; fused target states], unrolled by training-time test.

Matches speculators 0.9.0 (models/eagle3) and vLLM 0.32 (qwen3_eagle3.py, spec_decode/llm_base_proposer.py):
- Target states of `target_layer_ids` (low, mid, high; vLLM convention, id k = after k decoder layers) are
  concatenated in ascending id order (the order vLLM collects them) and fused by `fc` (3H -> H).
- The drafter's sequence pairs token x_t with the fused state of t-1 (vLLM shifts the input ids by one, so a
  document's first token is never an input); RoPE position t-1, as vLLM places the pair at the state's position.
- First layer: q/k/v see [input_layernorm(embedding) ; hidden_norm(hidden)] (2H wide); the residual is the raw
  hidden (or the normed one with norm_before_residual). Later layers are plain Qwen3 layers.
- Own final norm + lm_head over a draft vocabulary (the most frequent response tokens, sorted by target id);
  d2t[i] = target_id - i, t2d = bool mask over the target vocabulary (speculators' buffers, vLLM's
  draft_id_to_target_id).
- Drafting step s >= 1 feeds back the layer output (pre-norm) at position +1 with the previous step's token; its
  query sees the step-0 keys of its document up to its anchor plus its own keys from steps 1..s. This is
  speculators' diagonal draft mask over its growing KV cache, and exactly what vLLM's drafter KV cache holds.
- Training (speculators' forward): step 0 over every pair of the pack, steps 1..ttt_steps-1 teacher-forced with
  the true tokens, loss KL(target || draft) over the draft vocabulary, step weight decay^s (1.0: equal).
- Scored rows: step s of the chain anchored at pair t (input token t) when token t and the predicted token
  t+1+s are response tokens of one document. These are exactly the rows vLLM's acceptance counts: its first
  draft follows the target's first response token, so every served anchor is a response token and a draft
  past the response is never counted. speculators scores step s when token t+s is a response token, which
  also trains chains anchored in the prompt and the prediction past a document's last token; with its loss
  mask set to mask[t] & mask[t+1] both score the same rows on a document whose tokens after the first are all
  response (tests/drafters/test_eagle3.py checks loss and gradients on such a batch). Later steps run only on
  chains that carry a label (speculators runs every pair at every step).
- What step 0 computes (trainer.compute): later steps read step 0's keys and values at every pair, but its output
  only at the chains' own pairs. 'read' (default) runs the layers below the last at every pair and the last one's
  fc, embedding, norms and K/V there too, its query, attention, o_proj and MLP only at the chains (~264 of a mission
  pack's ~32k pairs); 'all' runs every layer at every pair (speculators' and vLLM's first pass). The KV cache, and so
  every step's output, is the same (tests/drafters/test_compute_read.py); propose() and draft_logits() share it.

Suffixes: T packed tokens, S drafter pairs, N chains (anchors), D hidden, H/d heads/head dim, V vocab.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specdistill.core.batch import PackedBatch
from specdistill.core.contract import FeatureSpec, TokenizedRow
from specdistill.core.rows import as_rows
from specdistill.core.target import RMSNorm, TargetHead, TargetInfo
from specdistill.drafters.base import Drafter, StepOutput, export_dtype, proposal_tokens, reads, speculators_block
from specdistill.drafters.layers import (LayerShape, QKVProjections, Rotary, SwiGLU, apply_rotary, init_linear,
                             layer_geometry, speculators_layer_config)
from specdistill.drafters.targets import DistinctTargets
from specdistill.kernels.attention import packed_causal_plan
from specdistill.kernels.logits import chunked_argmax, chunked_loss


@dataclass
class Eagle3Config:
    """Field-report defaults: 1 layer, draft vocab 32k, 3 TTT steps with equal weights, K=7 when served."""

    name: str = "eagle3"
    num_layers: int = 1
    target_layer_ids: list[int] | None = None  # None: vLLM's [2, L//2, L-3], spread over 1..L-1 if that clashes
    draft_vocab_size: int = 32000  # capped at the target's vocabulary
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0  # weight of step s is decay**s (speculators' default: equal)
    num_speculative_tokens: int = 7  # K served by vLLM
    norm_before_residual: bool = False  # written to the export: vLLM defaults a missing field to True
    train_lm_head: bool = False  # speculators 0.9.0 freezes it (initialised from the target's rows)
    # Attention geometry: None copies the target's.
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None  # None: the target's dense MLP width, else 3 x hidden
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None  # None: the target's
    attention_impl: str = "auto"  # step 0 (packed causal): auto | flex | chunked | reference
    init_from: str | None = None  # an export to start from (specdistill/drafters/warm_start.py); its architecture is used


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """vLLM's EAGLE-3 default (2, L//2, L-3) when it is 3 distinct ascending ids inside 1..L-1; otherwise
    (shallow targets: L=4 gives 2, 2, 1) three ids spread evenly over 1..L-1 (L=4 -> [1, 2, 3])."""
    L = num_hidden_layers
    ids = [2, L // 2, L - 3]
    if ids == sorted(set(ids)) and ids[0] >= 1 and ids[-1] <= L - 1:
        return ids
    return sorted({round(1 + i * (L - 2) / 2) for i in range(3)})


def build_draft_vocab(rows: Sequence[TokenizedRow], size: int, vocab_size: int | None = None) -> torch.Tensor:
    """Target ids of the draft vocabulary [size], ascending: the `size` most frequent response tokens (ties to the
    lower id); when fewer distinct ones exist, all of them, padded with the lowest unused ids so the shape never
    depends on the data (speculators' build_vocab_mappings_from_distribution). Deterministic in `rows`."""
    rows = as_rows(rows)
    vocab = vocab_size or 1 + max((max(r.input_ids) for r in rows), default=0)
    counts_V = rows.response_token_counts(vocab)  # vectorised over a token store (specdistill/core/rows.py)
    seen = np.flatnonzero(counts_V)
    chosen = seen[np.lexsort((seen, -counts_V[seen]))][:size].tolist()  # most frequent first, ties to the lower id
    taken, pad = set(chosen), iter(range(size + len(chosen)))
    while len(chosen) < size:
        t = next(pad)
        if t not in taken:
            chosen.append(t)
    return torch.tensor(sorted(chosen), dtype=torch.long)


class Eagle3Layer(nn.Module):
    """Qwen3 decoder layer; the first one takes [embedding ; hidden] into q/k/v (speculators' first layer)."""

    def __init__(self, shape: LayerShape, first: bool, norm_before_residual: bool):
        super().__init__()
        H, eps = shape.hidden, shape.eps
        self.first, self.norm_before_residual = first, norm_before_residual
        self.self_attn = QKVProjections(H, shape.num_heads, shape.num_kv_heads, shape.head_dim, eps)
        if first:
            attn = self.self_attn
            attn.q_proj = nn.Linear(2 * H, shape.num_heads * shape.head_dim, bias=False)
            attn.k_proj = nn.Linear(2 * H, shape.num_kv_heads * shape.head_dim, bias=False)
            attn.v_proj = nn.Linear(2 * H, shape.num_kv_heads * shape.head_dim, bias=False)
            self.hidden_norm = RMSNorm(H, eps)
        self.mlp = SwiGLU(H, shape.intermediate)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)

    def forward(self, embeds_QD, hidden_QD, rope, attend, rows_R=None) -> torch.Tensor:
        """attend(q_RHd, k_QHd, v_QHd) -> [R, H, d]: the caller owns the masks and the KV cache. rows_R: the rows
        whose output is wanted (default all): keys and values come from every row, the query, attention, o_proj and
        MLP only at these (compute='read': step 0's last layer at the chain anchors)."""
        if self.first:
            normed = self.hidden_norm(hidden_QD)
            residual = normed if self.norm_before_residual else hidden_QD
            x = torch.cat([self.input_layernorm(embeds_QD), normed], dim=-1)
        else:
            residual, x = hidden_QD, self.input_layernorm(hidden_QD)
        k, v = self.self_attn.keys_values(x)
        k = apply_rotary(k, *rope)
        if rows_R is not None:
            x, residual, rope = x[rows_R], residual[rows_R], (rope[0][rows_R], rope[1][rows_R])
        out = attend(apply_rotary(self.self_attn.queries(x), *rope), k, v)
        h = residual + self.self_attn.o_proj(out.reshape(x.shape[0], -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class ChainAttention:
    """Attention of unrolled step s >= 1: chain n (anchored at pair i_n) sees step-0 keys j <= i_n of its own
    document and its own keys of steps 1..s. One masked SDPA per document (chains sorted by pair index). With no own
    keys it is step 0's attention at the chains' own pairs (compute='read': the last layer's queries only there)."""

    def __init__(self, document_ids_S: torch.Tensor, chain_S_N: torch.Tensor):
        device = chain_S_N.device
        docs_N = document_ids_S[chain_S_N]
        self.groups = []  # (chains [n0, n1), context pairs [lo, hi), mask of the context part)
        bounds = torch.nonzero(docs_N[1:] != docs_N[:-1]).squeeze(-1).add(1).tolist()
        for n0, n1 in zip([0] + bounds, bounds + [chain_S_N.shape[0]]) if chain_S_N.numel() else ():
            in_doc = torch.nonzero(document_ids_S == docs_N[n0]).squeeze(-1)
            lo, hi = int(in_doc[0]), int(in_doc[-1]) + 1
            ctx = torch.arange(lo, hi, device=device)[None, :] <= chain_S_N[n0:n1, None]
            self.groups.append((n0, n1, lo, hi, ctx))

    def __call__(self, q_NHd, ctx_k_SHd, ctx_v_SHd, own_k: list, own_v: list, scale: float) -> torch.Tensor:
        outs = []
        for n0, n1, lo, hi, ctx in self.groups:
            m = n1 - n0
            k = torch.cat([ctx_k_SHd[lo:hi]] + [k_s[n0:n1] for k_s in own_k])
            v = torch.cat([ctx_v_SHd[lo:hi]] + [v_s[n0:n1] for v_s in own_v])
            eye = torch.eye(m, dtype=torch.bool, device=ctx.device)
            mask = torch.cat([ctx] + [eye] * len(own_k), dim=1)
            out = F.scaled_dot_product_attention(
                q_NHd[n0:n1].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=mask, scale=scale, enable_gqa=q_NHd.shape[1] != k.shape[1])
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs) if outs else q_NHd.new_zeros(0, q_NHd.shape[1], ctx_v_SHd.shape[-1])


@dataclass
class Pairs:
    """The drafter's sequence over a pack: pair i = (token at t_S[i], fused target state at t_S[i] - 1)."""

    t_S: torch.Tensor
    index_T: torch.Tensor  # pair index of token position t, -1 at a document's first token
    document_ids_S: torch.Tensor
    rope_pos_S: torch.Tensor


class Eagle3Drafter(Drafter):
    name = "eagle3"
    speculators_model_type = "eagle3"

    def __init__(self, cfg: Eagle3Config, target: TargetInfo):
        super().__init__()
        self.cfg, self.target = cfg, target
        self.target_layer_ids = list(cfg.target_layer_ids or default_layer_ids(target.num_hidden_layers))
        FeatureSpec(tuple(self.target_layer_ids)).check_against(target.num_hidden_layers)
        D, V = target.hidden_size, target.vocab_size
        self.draft_vocab_size = min(cfg.draft_vocab_size, V)
        self.shape = LayerShape.of(cfg, target)
        self.rope_theta = cfg.rope_theta or target.rope_theta
        self.fc = nn.Linear(len(self.target_layer_ids) * D, D, bias=False)
        self.layers = nn.ModuleList(Eagle3Layer(self.shape, i == 0, cfg.norm_before_residual)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(D, self.draft_vocab_size, bias=False)
        self.rotary = Rotary(self.shape.head_dim, self.rope_theta)
        self.apply(init_linear)
        self.lm_head.weight.requires_grad_(cfg.train_lm_head)
        # Identity mapping until prepare(); fixed shapes, so a checkpoint loads before or after prepare().
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(V) < self.draft_vocab_size)

    @classmethod
    def build(cls, cfg: Eagle3Config, target: TargetInfo, tokenizer) -> "Eagle3Drafter":
        return cls(cfg, target)

    def prepare(self, rows: Sequence[TokenizedRow]) -> None:
        """Draft vocabulary from the training rows' response tokens; lm_head = the target's rows for it."""
        draft_ids = build_draft_vocab(rows, self.draft_vocab_size, self.target.vocab_size).to(self.d2t.device)
        self.d2t.copy_(draft_ids - torch.arange(self.draft_vocab_size, device=draft_ids.device))
        self.t2d.zero_()
        self.t2d[draft_ids] = True
        lm_head = TargetHead(self.target).lm_head.weight
        self.lm_head.weight.data.copy_(lm_head[draft_ids.cpu()].to(self.lm_head.weight))

    # --- warm start ------------------------------------------------------------------------------------
    @classmethod
    def architecture_from_export(cls, config: dict) -> dict:
        layer = config["transformer_layer_config"]
        return {"num_layers": layer["num_hidden_layers"],
                "target_layer_ids": list(config["eagle_aux_hidden_state_layer_ids"]),
                "draft_vocab_size": config["draft_vocab_size"], "num_speculative_tokens": proposal_tokens(config),
                # vLLM reads a missing norm_before_residual as True
                "norm_before_residual": config.get("norm_before_residual", True), **layer_geometry(layer)}

    def load_export(self, path: Path) -> None:
        """The export's weights and its draft vocabulary (d2t / t2d, absent when it is the whole target
        vocabulary), which replaces the one prepare() built: the lm_head rows belong to it."""
        from specdistill.drafters.warm_start import load_weights

        if not self.uses_draft_vocab:
            self.d2t.zero_()
            self.t2d.fill_(True)
        load_weights(self, path, optional=frozenset() if self.uses_draft_vocab else frozenset({"d2t", "t2d"}))
        self.check_vocab_mapping(path)

    def check_vocab_mapping(self, source) -> None:
        """d2t and t2d must describe the same draft vocabulary, and the lm_head rows must be the target's rows of
        those tokens (frozen, as speculators trains them, or fine-tuned from them): a mapping saved from another
        vocabulary than the head's (peer tools' "stale d2t") accepts almost nothing when served."""
        ids = self.draft_ids.cpu()
        V = self.target.vocab_size
        if ids.min() < 0 or ids.max() >= V or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"{source}: d2t maps draft ids outside 0..{V - 1} or out of order: not a draft "
                             "vocabulary of this target")
        t2d = self.t2d.cpu()
        if int(t2d.sum()) != len(ids) or not bool(t2d[ids].all()):
            raise ValueError(f"{source}: t2d marks {int(t2d.sum())} target tokens, {int((~t2d[ids]).sum())} of d2t's "
                             f"{len(ids)} draft tokens unmarked: d2t and t2d describe different vocabularies")
        target_rows = TargetHead(self.target).lm_head.weight[ids]
        cos = F.cosine_similarity(self.lm_head.weight.detach().float().cpu(), target_rows.float(), dim=-1)
        agree = float((cos > 0.5).float().mean())
        if agree < 0.5:
            raise ValueError(f"{source}: only {agree:.0%} of lm_head's {len(ids)} rows resemble the target's rows of "
                             "the tokens d2t assigns them (cosine > 0.5): the vocabulary mapping is stale (saved "
                             "for another draft vocabulary than the head's), and served drafts would be wrong tokens")

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft id: draft_id + d2t[draft_id]."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    @property
    def num_speculative_tokens(self) -> int:
        return self.cfg.num_speculative_tokens

    def feature_spec(self) -> FeatureSpec:
        """Its layers at every position (step 0 attends to the whole document); the last layer (pre-norm: the
        target's own distribution, computed by the trainer) where a label's distribution is read, unless it is an
        input."""
        return reads(self.target_layer_ids, self.target.num_hidden_layers, context_window=None)

    # --- forward -----------------------------------------------------------------------------------
    def last_layer_at(self, batch: PackedBatch, positions_P: torch.Tensor) -> torch.Tensor:
        """The target's last-layer states [P, D] at pack positions (pre-norm): its distribution there."""
        return batch.layer_at(self.target.num_hidden_layers, positions_P)

    def pairs(self, batch: PackedBatch) -> Pairs:
        T, doc = batch.num_tokens, batch.document_ids_T
        has_prev = torch.zeros(T, dtype=torch.bool, device=doc.device)
        has_prev[1:] = doc[1:] == doc[:-1]
        t_S = torch.nonzero(has_prev).squeeze(-1)
        index_T = torch.full((T,), -1, dtype=torch.long, device=doc.device)
        index_T[t_S] = torch.arange(t_S.shape[0], device=doc.device)
        return Pairs(t_S, index_T, doc[t_S], batch.position_ids_T[t_S] - 1)

    def first_pass(self, batch: PackedBatch, head: TargetHead, pairs: Pairs, chain_S_N: torch.Tensor,
                   attention: ChainAttention | None):
        """Step 0 (the drafter's KV cache, as vLLM's first pass fills it): the last layer's outputs at the chains
        `chain_S_N` [N, D] and each layer's keys/values at every pair. compute='all' runs every layer at every pair;
        'read' runs the layers below the last at every pair (their outputs feed the last layer's keys), and the last
        one's query, attention, o_proj and MLP only at the chains (`attention`: its keys are the step-0 keys of the
        chain's document up to its pair; elsewhere later steps read only its keys and values)."""
        aux_SD = batch.layers(self.target_layer_ids)[pairs.t_S - 1].flatten(1)
        hidden_SD = self.fc(aux_SD)
        embeds_SD = head.embed_tokens(batch.input_ids_T[pairs.t_S]).to(hidden_SD.dtype)
        rope = self.rotary(pairs.rope_pos_S)
        scale, cache = self.layers[0].self_attn.scale, []
        every_pair = self.layers if self.compute == "all" else self.layers[:-1]
        if len(every_pair):
            plan = packed_causal_plan(pairs.document_ids_S, impl=self.cfg.attention_impl, static=batch.static)

        def attend(q, k, v):
            cache.append((k, v))
            return plan(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale)

        for layer in every_pair:
            hidden_SD = layer(embeds_SD, hidden_SD, rope, attend)
        if len(every_pair) == len(self.layers):
            return hidden_SD[chain_S_N], cache

        def attend_chains(q_NHd, k, v):
            cache.append((k, v))
            return attention(q_NHd, k, v, [], [], scale)

        return self.layers[-1](embeds_SD, hidden_SD, rope, attend_chains, rows_R=chain_S_N), cache

    def unroll(self, batch, head, pairs: Pairs, chain_S_N: torch.Tensor, steps: int, next_tokens):
        """Final-normed states [N, D] of steps 0..steps-1 for chains anchored at pairs `chain_S_N` (sorted);
        next_tokens(s, normed_ND) gives the tokens [N] fed to step s (teacher forcing, or the drafts)."""
        attention = (ChainAttention(pairs.document_ids_S, chain_S_N) if steps > 1 or self.compute == "read"
                     else None)
        hidden_ND, cache = self.first_pass(batch, head, pairs, chain_S_N, attention)
        normed = [self.norm(hidden_ND)]
        own = [([], []) for _ in self.layers]
        scale = self.layers[0].self_attn.scale
        for s in range(1, steps):
            embeds_ND = head.embed_tokens(next_tokens(s, normed[-1])).to(hidden_ND.dtype)
            rope = self.rotary(pairs.rope_pos_S[chain_S_N] + s)
            for layer, (ctx_k, ctx_v), (own_k, own_v) in zip(self.layers, cache, own):
                def attend(q, k, v, ctx_k=ctx_k, ctx_v=ctx_v, own_k=own_k, own_v=own_v):
                    own_k.append(k)
                    own_v.append(v)
                    return attention(q, ctx_k, ctx_v, own_k, own_v, scale)

                hidden_ND = layer(embeds_ND, hidden_ND, rope, attend)
            normed.append(self.norm(hidden_ND))
        return normed

    def chain_labels(self, batch: PackedBatch, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [S, ttt] that step s of the chain at each pair predicts (anchor + 1 + s), and which of
        them are scored: the anchor token and the predicted one are response tokens of the anchor's document
        (the rows vLLM's acceptance counts; module docstring)."""
        T = batch.num_tokens
        pos_SK = pairs.t_S[:, None] + 1 + torch.arange(self.cfg.ttt_steps, device=pairs.t_S.device)
        clamped = pos_SK.clamp(max=T - 1)
        same_doc = batch.document_ids_T[clamped] == pairs.document_ids_S[:, None]
        valid = (pos_SK < T) & batch.loss_mask_T[clamped] & same_doc & batch.loss_mask_T[pairs.t_S][:, None]
        return clamped, valid

    def unrolled_chains(self, valid_SK: torch.Tensor) -> torch.Tensor:
        """Pairs whose chain runs steps 1..ttt-1: those with a scored row (speculators runs every pair; the
        loss is the same, bench/step_vs_speculators.py times both)."""
        return torch.nonzero(valid_SK.any(1)).squeeze(-1)

    def training_step(self, batch: PackedBatch, head: TargetHead, generator: torch.Generator) -> StepOutput:
        pairs = self.pairs(batch)
        pos_SK, valid_SK = self.chain_labels(batch, pairs)
        chain_S_N = self.unrolled_chains(valid_SK)
        if chain_S_N.numel() == 0:  # no response token in the pack: a zero loss that still backpropagates
            zero = sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0
            empty = torch.zeros(0, self.cfg.ttt_steps, dtype=torch.bool, device=zero.device)
            return chain_metrics(zero, empty, empty, self.num_speculative_tokens)
        pos_NK, valid_NK = pos_SK[chain_S_N], valid_SK[chain_S_N]
        anchor_N = pairs.t_S[chain_S_N]
        # Teacher forcing (speculators): step s reads the true token at anchor + s.
        teacher = lambda s, _: batch.input_ids_T[(anchor_N + s).clamp(max=batch.num_tokens - 1)]  # noqa: E731
        normed = self.unroll(batch, head, pairs, chain_S_N, self.cfg.ttt_steps, teacher)
        draft_ids = self.draft_ids
        target = DistinctTargets(head, lambda p: self.last_layer_at(batch, p), pos_NK[valid_NK] - 1, draft_ids)
        loss = target.last_UD.new_zeros(())
        correct_NK = torch.zeros_like(valid_NK)
        for s, normed_ND in enumerate(normed):
            rows = valid_NK[:, s]
            if not rows.any():
                continue
            u_M = target.index(pos_NK[rows, s] - 1)  # the target's token at p comes from its state at p-1
            kl = chunked_loss("kl", normed_ND[rows], self.lm_head.weight, **target.loss_args(u_M))
            loss = loss + self.cfg.ttt_step_loss_decay**s * kl.loss.mean()
            predicted_M = draft_ids[kl.draft_token]
            # Correct = the target's greedy token over its whole vocabulary (the KL's is over the draft vocab).
            correct_NK[rows, s] = predicted_M == target.argmax_U[u_M]
        return chain_metrics(loss, correct_NK, valid_NK, self.num_speculative_tokens)

    @torch.no_grad()
    def propose(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        """vLLM's EAGLE-3 proposer: the first pass gives draft 1 at the anchor's pair, each further step feeds
        its own greedy draft (a target id) and its pre-norm output at the next position."""
        pairs = self.pairs(batch)
        chain_N = pairs.index_T[anchors_N]
        if (chain_N < 0).any():
            bad = anchors_N[chain_N < 0].tolist()
            raise ValueError(f"anchors {bad} are the first token of their document: EAGLE-3 drafts from a token "
                             "and the target state before it, so an anchor needs one earlier token")
        order = torch.argsort(chain_N)
        drafts = []

        def own_draft(s, normed_ND):
            drafts.append(self.draft_ids[chunked_argmax(normed_ND, self.lm_head.weight)])
            return drafts[-1]

        normed = self.unroll(batch, head, pairs, chain_N[order], self.num_speculative_tokens, own_draft)
        own_draft(len(normed), normed[-1])
        out = torch.stack(drafts, dim=1)
        return torch.empty_like(out).index_copy_(0, order, out)

    def draft_logits(self, batch: PackedBatch, head: TargetHead, anchors_N: torch.Tensor) -> torch.Tensor:
        pairs = self.pairs(batch)
        chain_N = pairs.index_T[anchors_N]
        order = torch.argsort(chain_N)
        anchor_sorted_N = anchors_N[order]
        last = batch.input_ids_T.shape[0] - 1  # past the row's end the teacher token is unknown and never scored
        teacher = lambda s, _: batch.input_ids_T[(anchor_sorted_N + s).clamp(max=last)]  # noqa: E731
        normed = self.unroll(batch, head, pairs, chain_N[order], self.num_speculative_tokens, teacher)
        draft_NKV = torch.stack([self.lm_head(x) for x in normed], 1)
        out = draft_NKV.new_full((*draft_NKV.shape[:2], head.lm_head.weight.shape[0]), float("-inf"))
        out[:, :, self.draft_ids] = draft_NKV  # draft id i is target id draft_ids[i] (d2t offsets)
        return torch.empty_like(out).index_copy_(0, order, out)

    # --- export ------------------------------------------------------------------------------------
    @property
    def uses_draft_vocab(self) -> bool:
        return self.draft_vocab_size != self.target.vocab_size

    def speculators_config(self, target: TargetInfo) -> dict:
        cfg, n = self.cfg, len(self.layers)
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": self.speculators_model_type,
            "speculators_version": "0.9.0",
            "transformer_layer_config": speculators_layer_config(self.shape, target, n, self.rope_theta),
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": target.hidden_size,
            # Same convention as vLLM's aux layers (id k = after k decoder layers), ascending: no offset.
            "eagle_aux_hidden_state_layer_ids": self.target_layer_ids,
            "norm_before_residual": cfg.norm_before_residual,
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
            "embed_requires_grad": False,
            "tie_word_embeddings": False,
            "dtype": target.torch_dtype,
            "speculators_config": speculators_block(self.speculators_model_type, self.num_speculative_tokens, target),
        }

    def export(self, out_dir: Path, target: TargetInfo) -> None:
        """embed_tokens stays out (vLLM and speculators take the target's); d2t/t2d only with a reduced vocab,
        as both readers expect (neither has the buffers when the vocabularies are equal)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        dtype = export_dtype(target)
        tensors = {k: (v if k in ("d2t", "t2d") else v.to(dtype)).detach().cpu().contiguous()
                   for k, v in self.state_dict().items() if self.uses_draft_vocab or k not in ("d2t", "t2d")}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        (out_dir / "config.json").write_text(json.dumps(self.speculators_config(target), indent=2) + "\n")


def speculators_loss_mask(pairs: Pairs, loss_mask_T: torch.Tensor) -> torch.Tensor:
    """speculators' loss mask over the pairs [S] under which its rule (score step s where mask[t+s]) scores the
    rows ours does, on a document whose tokens after the first are all response: mask[t] & mask[t+1] (module
    docstring). For loss comparisons with its Eagle3DraftModel (tests, bench/step_vs_speculators.py)."""
    t_S = pairs.t_S
    return loss_mask_T[t_S] & torch.cat([loss_mask_T[t_S[:-1] + 1], loss_mask_T.new_zeros(1)])


def chain_metrics(loss, correct_NS, valid_NS, K: int) -> StepOutput:
    """Per-step accuracy padded to the K served positions (steps past ttt_steps are never scored) and the
    accepted-prefix length of each chain whose first step is scored."""
    pad = max(0, K - correct_NS.shape[1])
    correct_NK = F.pad(correct_NS & valid_NS, (0, pad))[:, :K]
    valid_NK = F.pad(valid_NS, (0, pad))[:, :K]
    scored = valid_NK[:, 0]
    accepted = torch.cumprod(correct_NK.long(), dim=1).sum(1)
    return StepOutput(loss=loss, correct_K=correct_NK.sum(0), total_K=valid_NK.sum(0),
                      accepted_prefix_sum=accepted[scored].sum(), blocks=scored.sum())
