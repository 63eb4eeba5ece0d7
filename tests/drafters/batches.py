"""A random packed batch for the drafter tests: documents of the given lengths, each a prompt then a response."""

import torch

from specdistill.core.batch import PackedBatch
from specdistill.core.contract import FeatureSample
from specdistill.core.target import TargetInfo


def make_batch(info: TargetInfo, layer_ids, lengths=(20, 14), prompt=(8, 6), seed=0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    return PackedBatch(
        input_ids_T=torch.randint(0, info.vocab_size, (T,), generator=g),
        loss_mask_T=torch.cat([torch.arange(n) >= p for n, p in zip(lengths, prompt)]),
        hidden_TLD=torch.randn(T, len(layer_ids), info.hidden_size, generator=g),
        document_ids_T=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
        position_ids_T=torch.cat([torch.arange(n) for n in lengths]),
        layer_ids=tuple(layer_ids),
        row_ids=tuple(range(len(lengths))),
    )


def make_samples(info: TargetInfo, layer_ids, lengths=(40, 36), response=(12, 10), seed=0) -> list[FeatureSample]:
    """Rows as the feed delivers them (core/batch.py pack() lays them out): each a prompt, then `response` tokens."""
    g = torch.Generator().manual_seed(seed)
    return [FeatureSample(row_id=i, input_ids_T=torch.randint(0, info.vocab_size, (n,), generator=g),
                          loss_mask_T=torch.arange(n) >= n - r,
                          hidden_TLD=torch.randn(n, len(layer_ids), info.hidden_size, generator=g))
            for i, (n, r) in enumerate(zip(lengths, response))]


def step_and_grads(drafter, head, batch, seed=0):
    """One training step's output and the gradient of every parameter it reached (the drafter's are cleared first)."""
    drafter.zero_grad(set_to_none=True)
    out = drafter(batch, head, torch.Generator().manual_seed(seed))
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def small_drafter(name, tiny_llama_dir, tmp_path):
    """(target info, drafter): each drafter small (1 layer, 3 draft tokens) on tiny-llama; MTP on an unfitted
    tiny-qwen3-next (it needs the target's MTP layer)."""
    from specdistill.drafters.dflash import DFlashConfig, DFlashDrafter
    from specdistill.drafters.dflash2 import DFlash2Config, DFlash2Drafter
    from specdistill.drafters.dspark import DSparkConfig, DSparkDrafter
    from specdistill.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from specdistill.drafters.mtp import MTPConfig, MTPDrafter

    if name == "mtp":
        from specdistill.launch.targets import make_target

        info = TargetInfo.load(make_target("tiny-qwen3-next", tmp_path / "t", fit_steps=0))
        return info, MTPDrafter(MTPConfig(num_speculative_tokens=3), info)
    info = TargetInfo.load(tiny_llama_dir)
    small = dict(num_layers=1, target_layer_ids=[1, 2, 3], sliding_window=None, block_size=4, init_from_target=False)
    if name == "eagle3":
        drafter = Eagle3Drafter(Eagle3Config(target_layer_ids=[1, 2, 3], num_speculative_tokens=3,
                                             draft_vocab_size=64), info)
        drafter.prepare([])
        return info, drafter
    cls, cfg = {"dflash": (DFlashDrafter, DFlashConfig), "dspark": (DSparkDrafter, DSparkConfig),
                "dflash2": (DFlash2Drafter, DFlash2Config)}[name]
    return info, cls(cfg(**small), info, 3)
