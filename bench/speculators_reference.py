"""speculators 0.9.0's own classes as the reference our drafters are compared with (the parity tests under
tests/drafters/ and bench/step_vs_speculators.py): the model loaded from our export, and its anchor selection."""


def load_reference(model_cls, config_cls, export_dir, head):
    """speculators' own model for our export: fp32, eager attention (a dense float mask; no flex on CPU), the
    verifier's norm and lm_head loaded. speculators 0.9.0 + transformers 5.19 can leave embed_tokens as
    uninitialised memory, not the NaN its load_verifier_weights() tests for (seen: 1 run in 3 drew garbage), so
    the target's embeddings are copied in: they are the target's in both implementations."""
    config = config_cls.from_pretrained(str(export_dir))
    config.transformer_layer_config._attn_implementation = "eager"
    ref = model_cls.from_pretrained(str(export_dir), config=config).float()
    ref.load_verifier_weights()
    ref.embed_tokens.weight.data.copy_(head.embed_tokens.weight)
    return ref


def all_anchors(batch, block_size: int):
    """(anchors, count): every valid anchor by speculators' own select_anchors, so the selection is
    deterministic and both implementations draft the same blocks."""
    from speculators.models.dflash.utils import select_anchors

    n_valid = int(batch.loss_mask_T[:-block_size].sum())
    anchors, _ = select_anchors(batch.loss_mask_T[None].long(), n_valid, block_size)
    return anchors, n_valid
