"""Response-only logits and losses (CE, KL, TV): chunked custom autograd beside the naive references."""

from specdistill.kernels.logits.chunked import DEFAULT_CHUNK, LossRows, chunked_argmax, chunked_ce, chunked_kl, chunked_loss, chunked_tv
from specdistill.kernels.logits.reference import ce_reference, kl_reference, tv_reference

__all__ = ["DEFAULT_CHUNK", "LossRows", "chunked_argmax", "chunked_loss", "ce_reference", "chunked_ce", "chunked_kl", "chunked_tv", "kl_reference", "tv_reference"]
