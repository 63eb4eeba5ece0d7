"""The learnable stream every drafter's training test uses: each token fixes the next, and the target states
are a function of the token, so a drafter that learns anything at all drives its loss down."""

import torch


def make_learnable(batch, info):
    """Rewrite a PackedBatch in place: token chain t -> 7t + 3 (mod vocab), states = a fixed table row per token."""
    ids = [5]
    for _ in range(batch.num_tokens - 1):
        ids.append((ids[-1] * 7 + 3) % info.vocab_size)
    batch.input_ids_T = torch.tensor(ids)
    table = torch.randn(info.vocab_size, info.hidden_size, generator=torch.Generator().manual_seed(3))
    batch.hidden_TLD = table[batch.input_ids_T][:, None].expand_as(batch.hidden_TLD).contiguous()
    return batch


def train_losses(drafter, batch, head, steps: int):
    """AdamW (lr 1e-2) on the trainable parameters for `steps` steps: (losses, last step's output)."""
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        out = drafter.training_step(batch, head, g)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    return losses, out
