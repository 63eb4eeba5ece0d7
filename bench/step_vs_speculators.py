"""Train-step time, ours vs speculators 0.9.0, for EAGLE-3 and DFlash on CPU (fp32), on one packed batch.

    python bench/step_vs_speculators.py [--quick] [--tokens T] [--warmup W] [--steps N]

A step is forward + loss + backward + AdamW step + zero_grad, on each side:
- ours: specdistill/drafters/eagle3.py Eagle3Drafter.training_step / specdistill/drafters/dflash.py DFlashDrafter.training_step;
- theirs: speculators.models.eagle3 Eagle3DraftModel / speculators.models.dflash DFlashDraftModel forward
  (eager attention, eager losses: their fused losses need Triton).
Both sides have the same architecture; speculators' model is loaded from our export, so weights are equal.
Loss on each side as each trains it: EAGLE-3 KL over 3 TTT steps (equal weights; speculators also scores the
prompt-anchored chains vLLM never drafts, specdistill/drafters/eagle3.py); DFlash CE to the target's greedy token with D-PACE
position weights over max_anchors anchors of block 8.
Before timing, each drafter's loss check must pass: both sides' losses on the same weights and the same scored
rows agree within 1e-4 relative (EAGLE-3: the pack's first document as all response; DFlash: every valid anchor,
so both select the same blocks), else the bench stops. Ours saves work four ways, and the ablation rows separate
them: `*_compute_all` (trainer.compute=all: EAGLE-3's step 0 runs its last layer at every pair, DFlash its fc and K/V
over the whole context), and on top of that `*_all_chains` (EAGLE-3 unrolls every pair, as speculators does) and
`*_reference_attention` (a dense mask, as speculators' eager attention, instead of chunked per-document attention);
what remains of the gap is the response-only loss (logits only where a row is scored). speculators runs as it can on a CPU (the
`speculators_configuration` line): eager attention and eager losses, not its CUDA/Triton paths.
Steps alternate between all variants so they share the machine's noise; the median of the timed steps is reported.
Prints `{drafter}_{variant}_ratio` (variant / speculators) for the ablations, then last `eagle3_step_ratio: R`
and `dflash_step_ratio: R` (ours / speculators; < 1: ours is faster).
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

from bench.speculators_reference import all_anchors, load_reference  # noqa: E402
from specdistill.core.batch import PackedBatch  # noqa: E402
from specdistill.core.contract import TokenizedRow  # noqa: E402
from specdistill.core.target import TargetHead, TargetInfo  # noqa: E402
from specdistill.drafters.dflash import DFlashConfig, DFlashDrafter  # noqa: E402
from specdistill.drafters.eagle3 import Eagle3Config, Eagle3Drafter, speculators_loss_mask  # noqa: E402

TARGET = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
MASK_TOKEN_ID = 3
# What speculators runs as here: the configuration it supports on a CPU, not the one it is tuned for.
SPECULATORS_CPU = ("CPU eager: attention 'eager' (a dense float mask per layer; its flex-attention path needs "
                   "CUDA), losses 'eager' (its fused losses need Triton), fp32, no torch.compile")


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


class AllChainsEagle3(Eagle3Drafter):
    """Ablation: steps 1..ttt-1 run on every pair, as speculators does (the loss is unchanged)."""

    def unrolled_chains(self, valid_SK: torch.Tensor) -> torch.Tensor:
        return torch.arange(valid_SK.shape[0], device=valid_SK.device)


def single_document(batch: PackedBatch, doc: int) -> PackedBatch:
    """Document `doc` of the pack alone, every token after the first a response token: the batch on which
    EAGLE-3's scored rows are speculators' (specdistill/drafters/eagle3.py docstring), for the loss check."""
    keep = batch.document_ids_T == doc
    T = int(keep.sum())
    return PackedBatch(input_ids_T=batch.input_ids_T[keep], loss_mask_T=torch.arange(T) >= 1,
                       hidden_TLD=batch.hidden_TLD[keep], document_ids_T=torch.zeros(T, dtype=torch.long),
                       position_ids_T=torch.arange(T), layer_ids=batch.layer_ids,
                       row_ids=(doc,))


def eagle3_sides(info, head, batch, tmp: Path, ttt_steps: int):
    """(our step functions by name, our drafter, a factory of speculators' step and model, the loss check)."""
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    def build(cls=Eagle3Drafter, attention_impl="auto", compute="read"):
        torch.manual_seed(0)  # every variant starts from the same weights
        drafter = cls(Eagle3Config(target_layer_ids=[1, 2, 3], num_layers=1, ttt_steps=ttt_steps,
                                   draft_vocab_size=info.vocab_size, attention_impl=attention_impl), info).train()
        # Every token is a response token: draft vocab = the whole target vocab, lm_head = the target's.
        drafter.prepare([TokenizedRow(0, tuple(range(info.vocab_size)), (1,) * info.vocab_size)])
        drafter.compute = compute
        return drafter

    drafter = build()
    variants = {"ours": drafter, "ours_compute_all": build(compute="all"),
                "ours_all_chains": build(AllChainsEagle3, compute="all"),
                "ours_reference_attention": build(attention_impl="reference", compute="all")}
    ours = {name: our_step(d, batch, head) for name, d in variants.items()}
    loss_config = resolve_loss_config("kl_div", "eager")

    def reference_loss(ref, b: PackedBatch, mask_rule: str):
        """speculators' forward on a pack, shifted as its shift_batch does per document: input x[1:], hidden
        g[:-1], verifier y[1:]; loss mask l[1:] (its own rule) or mask[t] & mask[t+1] (ours; the check)."""
        pairs = drafter.pairs(b)
        t_S = pairs.t_S
        mask = speculators_loss_mask(pairs, b.loss_mask_T) if mask_rule == "ours" else b.loss_mask_T[t_S]
        _, loss, _ = ref(b.layers(drafter.target_layer_ids)[t_S - 1].flatten(1)[None].contiguous(),
                         b.input_ids_T[t_S][None], pairs.document_ids_S[None], loss_mask=mask[None],
                         position_ids=pairs.rope_pos_S[None],
                         verifier_last_hidden_states=b.layers([info.num_hidden_layers])[t_S, 0][None].contiguous(),
                         ttt_steps=ttt_steps, ttt_step_loss_decay=1.0, loss_config=loss_config)
        return loss

    def theirs_factory():
        export = tmp / "eagle3"
        drafter.export(export, info)
        ref = load_reference(Eagle3DraftModel, Eagle3SpeculatorConfig, export, head).train()
        return make_step(lambda: reference_loss(ref, batch, "speculators"), ref), ref

    def loss_check(ref):
        one = single_document(batch, 0)
        with torch.no_grad():
            return (float(drafter.training_step(one, head, torch.Generator().manual_seed(0)).loss),
                    float(reference_loss(ref, one, "ours")))

    return ours, drafter, theirs_factory, loss_check


def dflash_sides(info, head, batch, tmp: Path, num_layers: int, max_anchors: int):
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    def build(attention_impl="auto", compute="read"):
        torch.manual_seed(0)
        drafter = DFlashDrafter(DFlashConfig(num_layers=num_layers, target_layer_ids=[1, 2, 3], sliding_window=None,
                                             max_anchors=max_anchors, loss_weighting="dpace",
                                             attention_impl=attention_impl),
                                info, mask_token_id=MASK_TOKEN_ID).train()
        drafter.compute = compute
        return drafter

    drafter = build()
    ours = {"ours": our_step(drafter, batch, head),
            "ours_compute_all": our_step(build(compute="all"), batch, head),
            "ours_reference_attention": our_step(build("reference", compute="all"), batch, head)}
    aux = batch.layers(drafter.target_layer_ids).flatten(1)[None].contiguous()
    last = batch.layers([info.num_hidden_layers])[:, 0][None].contiguous()
    loss_config = resolve_loss_config("ce", "eager")  # CE to the target's argmax, as ours

    def reference_loss(ref, anchors: int):
        _, loss, _ = ref(aux, batch.input_ids_T[None], batch.loss_mask_T[None].long(), last,
                         batch.document_ids_T[None], batch.position_ids_T[None], loss_config=loss_config,
                         max_anchors=anchors, per_position_loss_weight="dpace", dpace_alpha=0.5)
        return loss

    def theirs_factory():
        export = tmp / "dflash"
        drafter.export(export, info)
        ref = load_reference(DFlashDraftModel, DFlashSpeculatorConfig, export, head).train()
        return make_step(lambda: reference_loss(ref, max_anchors), ref), ref

    def loss_check(ref):
        # Every valid anchor on both sides, so the selection is deterministic and the blocks are the same.
        anchors, n_valid = all_anchors(batch, drafter.block_size)
        with torch.no_grad():
            return float(drafter.block_loss(batch, head, anchors).loss), float(reference_loss(ref, n_valid))

    return ours, drafter, theirs_factory, loss_check


def our_step(drafter, batch: PackedBatch, head: TargetHead):
    g = torch.Generator().manual_seed(0)
    return make_step(lambda: drafter.training_step(batch, head, g).loss, drafter)


LOSS_RTOL = 1e-4  # fp32 over a whole pack; tests/drafters/*: 1e-5 on small batches


def race(name: str, ours: dict, theirs_factory, loss_check, warmup: int, steps: int):
    """Median step seconds of each of our variants and of speculators (None where it did not run, with why).
    Before any timing, both sides' losses on the same weights and blocks must agree (else SystemExit)."""
    try:
        theirs, ref = theirs_factory()
        print(f"{name}_speculators_trainable_params: {sum(p.numel() for p in trainable(ref))}")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        theirs, why = None, f"construction failed: {type(e).__name__}: {e}"
    if theirs is not None:
        loss_o, loss_t = loss_check(ref)
        print(f"{name}_loss_check: ours {loss_o:.6f} speculators {loss_t:.6f}")
        if abs(loss_o - loss_t) > LOSS_RTOL * abs(loss_t):
            raise SystemExit(f"{name}: ours and speculators compute different losses on the same weights and "
                             f"blocks ({loss_o:.6f} vs {loss_t:.6f}); timing them would compare different work")
    times = {k: [] for k in ours}
    times_t = []
    for i in range(warmup + steps):
        for variant, step in ours.items():  # alternate, so every side shares the machine's noise
            t, _ = step()
            if i >= warmup:
                times[variant].append(t)
        if theirs is not None:
            try:
                t, _ = theirs()
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
                theirs, why = None, f"step failed: {type(e).__name__}: {e}"
                times_t = []
                continue
            if i >= warmup:
                times_t.append(t)
    medians = {k: statistics.median(v) for k, v in times.items()}
    medians["speculators"] = statistics.median(times_t) if theirs is not None else None
    return medians, (None if theirs is not None else why)


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
        ours, drafter, theirs, check = eagle3_sides(info, head, batch, tmp, args.ttt_steps)
        print(f"eagle3_ours_trainable_params: {sum(p.numel() for p in trainable(drafter))}")
        results["eagle3"] = race("eagle3", ours, theirs, check, warmup, steps)
        ours, drafter, theirs, check = dflash_sides(info, head, batch, tmp, args.dflash_layers, max_anchors)
        print(f"dflash_ours_trainable_params: {sum(p.numel() for p in trainable(drafter))}")
        results["dflash"] = race("dflash", ours, theirs, check, warmup, steps)

    print(f"speculators_configuration: {SPECULATORS_CPU}")
    for name, (medians, why) in results.items():
        for variant, med in medians.items():
            shown = f"{med:.4f}" if med is not None else f"unavailable ({why})"
            print(f"{name}_{variant}_step_s: {shown}")
    for name, (medians, why) in results.items():  # ablations first, the headline ratios last
        for variant in medians:
            if variant.startswith("ours_") and medians["speculators"]:
                print(f"{name}_{variant.removeprefix('ours_')}_ratio: {medians[variant] / medians['speculators']:.3f}")
    for name, (medians, why) in results.items():
        ref = medians["speculators"]
        print(f"{name}_step_ratio: {medians['ours'] / ref:.3f}" if ref else f"{name}_step_ratio: nan ({why})")

if __name__ == "__main__":
    main()
