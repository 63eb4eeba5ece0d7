"""Train-step time, ours vs speculators 0.9.0, for EAGLE-3 and DFlash on CPU (fp32), on one packed batch.

    python bench/step_vs_speculators.py [--quick] [--tokens T] [--warmup W] [--steps N]

A step is forward + loss + backward + AdamW step + zero_grad, on each side:
- ours: drafters/eagle3.py Eagle3Drafter.training_step / drafters/dflash.py DFlashDrafter.training_step;
- theirs: speculators.models.eagle3 Eagle3DraftModel / speculators.models.dflash DFlashDraftModel forward
  (eager attention, eager losses: their fused losses need Triton).
Both sides have the same architecture; speculators' model is loaded from our export, so weights are equal.
Loss on each side as each trains it: EAGLE-3 KL over 3 TTT steps (equal weights); DFlash CE to the target's
greedy token with D-PACE position weights over max_anchors anchors of block 8.
Steps alternate ours/theirs so both share the machine's noise; the median of the timed steps is reported.
Prints last `eagle3_step_ratio: R` and `dflash_step_ratio: R` (ours / speculators; < 1: ours is faster).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafters.dflash import DFlashConfig, DFlashDrafter  # noqa: E402
from drafters.eagle3 import Eagle3Config, Eagle3Drafter  # noqa: E402
from feature_server.contract import TokenizedRow  # noqa: E402
from trainer.batch import PackedBatch  # noqa: E402
from trainer.target import TargetHead, TargetInfo  # noqa: E402

TARGET = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
MASK_TOKEN_ID = 3


def build_target(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TARGET)).save_pretrained(path)


def make_pack(info: TargetInfo, layer_ids, T: int, response_frac: float = 0.25, seed: int = 0) -> PackedBatch:
    """One pack of T tokens: 8 documents of uneven length, the last ~response_frac of each is the response."""
    shares = [320, 192, 256, 384, 224, 288, 160, 224]  # sums to 2048
    lengths = [max(8, round(s * T / 2048)) for s in shares]
    lengths[-1] += T - sum(lengths)
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.cat([torch.arange(n) >= n - round(response_frac * n) for n in lengths])
    return PackedBatch(
        input_ids_T=torch.randint(0, info.vocab_size, (T,), generator=g),
        loss_mask_T=loss_mask,
        hidden_TLD=torch.randn(T, len(layer_ids), info.hidden_size, generator=g),
        document_ids_T=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
        position_ids_T=torch.cat([torch.arange(n) for n in lengths]),
        layer_ids=tuple(layer_ids),
        row_ids=tuple(range(len(lengths))),
    ), lengths


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def make_step(forward_loss, model):
    opt = torch.optim.AdamW(trainable(model), lr=1e-4)

    def step() -> float:
        t0 = time.perf_counter()
        loss = forward_loss()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, float(loss.detach())

    return step


def load_reference(cls, cfg_cls, export_dir: Path, head: TargetHead):
    ref_config = cfg_cls.from_pretrained(str(export_dir))
    ref_config.transformer_layer_config._attn_implementation = "eager"  # dense float mask; no flex on CPU
    ref = cls.from_pretrained(str(export_dir), config=ref_config).float().train()
    ref.load_verifier_weights()
    # speculators 0.9.0 + transformers 5.19 can leave embed_tokens as uninitialised memory (see the parity tests).
    ref.embed_tokens.weight.data.copy_(head.embed_tokens.weight)
    return ref


def eagle3_sides(info, head, batch, tmp: Path, ttt_steps: int):
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config(target_layer_ids=[1, 2, 3], num_layers=1, ttt_steps=ttt_steps,
                                         draft_vocab_size=info.vocab_size), info).train()
    # Every token is a response token: draft vocab = the whole target vocab, lm_head = the target's.
    drafter.prepare([TokenizedRow(0, tuple(range(info.vocab_size)), (1,) * info.vocab_size)])
    g = torch.Generator().manual_seed(0)
    ours = make_step(lambda: drafter.training_step(batch, head, g).loss, drafter)

    def theirs_factory():
        export = tmp / "eagle3"
        drafter.export(export, info)
        ref = load_reference(Eagle3DraftModel, Eagle3SpeculatorConfig, export, head)
        pairs = drafter.pairs(batch)
        # speculators' shift_batch per document: input x[1:], hidden g[:-1], verifier y[1:], loss mask l[1:].
        aux = batch.layers(drafter.target_layer_ids)[pairs.t_S - 1].flatten(1)[None].contiguous()
        ids = batch.input_ids_T[pairs.t_S][None]
        docs = pairs.document_ids_S[None]
        last = batch.layers([info.num_hidden_layers])[:, 0][pairs.t_S][None].contiguous()
        mask = batch.loss_mask_T[pairs.t_S][None]
        loss_config = resolve_loss_config("kl_div", "eager")

        def fwd():
            _, loss, _ = ref(aux, ids, docs, loss_mask=mask, position_ids=pairs.rope_pos_S[None],
                             verifier_last_hidden_states=last, ttt_steps=ttt_steps, ttt_step_loss_decay=1.0,
                             loss_config=loss_config)
            return loss

        return make_step(fwd, ref), ref

    return ours, drafter, theirs_factory


def dflash_sides(info, head, batch, tmp: Path, num_layers: int, max_anchors: int):
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    torch.manual_seed(0)
    drafter = DFlashDrafter(DFlashConfig(num_layers=num_layers, target_layer_ids=[1, 2, 3], sliding_window=None,
                                         max_anchors=max_anchors, loss_weighting="dpace"),
                            info, mask_token_id=MASK_TOKEN_ID).train()
    g = torch.Generator().manual_seed(0)
    ours = make_step(lambda: drafter.training_step(batch, head, g).loss, drafter)

    def theirs_factory():
        export = tmp / "dflash"
        drafter.export(export, info)
        ref = load_reference(DFlashDraftModel, DFlashSpeculatorConfig, export, head)
        aux = batch.layers(drafter.target_layer_ids).flatten(1)[None].contiguous()
        last = batch.layers([info.num_hidden_layers])[:, 0][None].contiguous()
        loss_config = resolve_loss_config("ce", "eager")  # CE to the target's argmax, as ours

        def fwd():
            _, loss, _ = ref(aux, batch.input_ids_T[None], batch.loss_mask_T[None].long(), last,
                             batch.document_ids_T[None], batch.position_ids_T[None], loss_config=loss_config,
                             max_anchors=max_anchors, per_position_loss_weight="dpace", dpace_alpha=0.5)
            return loss

        return make_step(fwd, ref), ref

    return ours, drafter, theirs_factory


def race(name: str, ours, theirs_factory, warmup: int, steps: int):
    """Median step seconds (ours, theirs or None) and why theirs did not run (or None)."""
    try:
        theirs, ref = theirs_factory()
        print(f"{name}_speculators_trainable_params: {sum(p.numel() for p in trainable(ref))}")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        theirs, why = None, f"construction failed: {type(e).__name__}: {e}"
    times_o, times_t = [], []
    for i in range(warmup + steps):
        t, loss_o = ours()
        if i >= warmup:
            times_o.append(t)
        if theirs is not None:
            try:
                t, loss_t = theirs()
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
                theirs, why = None, f"step failed: {type(e).__name__}: {e}"
                times_t = []
                continue
            if i >= warmup:
                times_t.append(t)
            if i == 0:
                print(f"{name}_first_losses: ours {loss_o:.4f} speculators {loss_t:.4f}")
    med_o = statistics.median(times_o)
    med_t = statistics.median(times_t) if theirs is not None else None
    return med_o, med_t, (None if theirs is not None else why)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T=1024, 1 warm-up + 3 timed steps")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--dflash-layers", type=int, default=5)
    ap.add_argument("--max-anchors", type=int, default=None)
    ap.add_argument("--ttt-steps", type=int, default=3)
    args = ap.parse_args()
    T = args.tokens or (1024 if args.quick else 2048)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps or (3 if args.quick else 5)
    max_anchors = args.max_anchors or T // 8  # half of the ~25% response tokens: both sides draw that many
    torch.manual_seed(0)

    import speculators
    import transformers

    try:  # speculators logs every verifier-file lookup through loguru
        from loguru import logger

        logger.disable("speculators")
    except ImportError:
        pass

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        build_target(tmp / "target")
        info = TargetInfo.load(tmp / "target")
        head = TargetHead(info)
        layer_ids = [1, 2, 3, info.num_hidden_layers]
        batch, lengths = make_pack(info, layer_ids, T)
        config = dict(
            target=TARGET, tokens=T, documents=lengths, response_tokens=int(batch.loss_mask_T.sum()),
            dtype="float32", device="cpu", threads=torch.get_num_threads(), warmup=warmup, timed_steps=steps,
            optimizer="AdamW(lr=1e-4)", eagle3=dict(num_layers=1, ttt_steps=args.ttt_steps, target_layer_ids=[1, 2, 3],
                                                   draft_vocab=info.vocab_size, loss="kl_div"),
            dflash=dict(num_layers=args.dflash_layers, block_size=8, max_anchors=max_anchors, target_layer_ids=[1, 2, 3],
                        sliding_window=None, loss="ce+dpace"),
            speculators=speculators.__version__ if hasattr(speculators, "__version__") else "0.9.0",
            transformers=transformers.__version__, torch=torch.__version__, their_attn="eager", their_loss="eager")
        print(f"config: {json.dumps(config)}")

        results = {}
        ours, drafter, theirs = eagle3_sides(info, head, batch, tmp, args.ttt_steps)
        print(f"eagle3_ours_trainable_params: {sum(p.numel() for p in trainable(drafter))}")
        results["eagle3"] = race("eagle3", ours, theirs, warmup, steps)
        ours, drafter, theirs = dflash_sides(info, head, batch, tmp, args.dflash_layers, max_anchors)
        print(f"dflash_ours_trainable_params: {sum(p.numel() for p in trainable(drafter))}")
        results["dflash"] = race("dflash", ours, theirs, warmup, steps)

    for name, (med_o, med_t, why) in results.items():
        print(f"{name}_ours_step_s: {med_o:.4f}")
        if med_t is None:
            print(f"{name}_speculators_step_s: unavailable ({why})")
        else:
            print(f"{name}_speculators_step_s: {med_t:.4f}")
    for name, (med_o, med_t, why) in results.items():
        print(f"{name}_step_ratio: {med_o / med_t:.3f}" if med_t else f"{name}_step_ratio: nan ({why})")


if __name__ == "__main__":
    main()
