"""Feature ablation: train and evaluate a drafter with the target's states taken away, to show it uses them.

    specdistill-train ... trainer.feature_ablation=zero      # or shuffle

`zero` replaces every drafter input layer by zeros; `shuffle` permutes the token positions of those layers across
the pack (same statistics, no alignment with the tokens). The last layer (id L) is left alone when the drafter
only uses it for the target's distribution: the labels stay the target's. A drafter that reads layer L as an
input (MTP) cannot be ablated this way, and says so. A drafter that loses most of its acceptance under ablation
uses the target's states; one that does not has learned token statistics only.
"""

from dataclasses import replace

import torch

from specdistill.core.batch import PackedBatch

ABLATIONS = ("none", "zero", "shuffle")


def check_ablation(mode: str, input_layer_ids: list[int], num_hidden_layers: int) -> None:
    if mode not in ABLATIONS:
        raise ValueError(f"trainer.feature_ablation={mode!r}; valid: {', '.join(ABLATIONS)}")
    if mode != "none" and num_hidden_layers in input_layer_ids:
        raise ValueError(f"trainer.feature_ablation={mode}: this drafter reads layer {num_hidden_layers} (the last, "
                         "which also gives the target's distribution) as an input, so its inputs cannot be ablated "
                         "without changing the labels")


def ablate_hidden(hidden_TLD: torch.Tensor, layer_ids: tuple[int, ...], mode: str, input_layer_ids: list[int],
                  generator: torch.Generator, real_tokens: int | None = None) -> torch.Tensor:
    """hidden_TLD (layers in `layer_ids` order) with the drafter's input layers zeroed or position-shuffled.
    real_tokens: the first positions that are rows (the rest a padded pack's padding, core/shapes.py): only they
    are shuffled among themselves, so a padded pack is ablated as its unpadded one (the same permutation)."""
    if mode == "none":
        return hidden_TLD
    cols = [layer_ids.index(i) for i in input_layer_ids]
    out = hidden_TLD.clone()
    if mode == "zero":
        out[:, cols] = 0
    else:
        n = hidden_TLD.shape[0] if real_tokens is None else real_tokens
        perm = torch.randperm(n, generator=generator).to(hidden_TLD.device)
        out[:n, cols] = hidden_TLD[:n][perm][:, cols]
    return out


def ablate(batch: PackedBatch, mode: str, input_layer_ids: list[int], generator: torch.Generator) -> PackedBatch:
    """`batch` with its drafter input layers ablated ("none": the batch itself)."""
    if mode == "none":
        return batch
    return replace(batch, hidden_TLD=ablate_hidden(batch.hidden_TLD, batch.layer_ids, mode, input_layer_ids,
                                                   generator, batch.num_real_tokens))
