"""Kernel benchmarks (not a test): `python bench/kernels.py [--quick] [--device cpu|cuda] [--skip moe,logits,...]`.

Prints, last, one line each (ratios measured in this one process against the references):
  moe_grouped_speedup: R           Qwen3-Next MoE block fwd+bwd, transformers eager loop fp32 / ours bf16
  moe_vs_eager_bf16: R             the same eager loop in bf16 / ours bf16 (the dtype-for-dtype comparison)
  moe_vs_transformers_grouped: R   transformers' grouped_mm experts bf16 / ours bf16 (>1: we are faster)
  response_logits_memory_ratio: R  peak memory of the loss stage, response-only chunked / full [T, V] logits
  attention_cpu_speedup: R         DFlash anchor-block attention fwd+bwd, dense-mask SDPA / our path,
                                   geometric mean over packing lengths 4k and 16k (on CUDA: flex vs dense)
Defaults follow issue 4 (MoE: hidden 512, 64 experts, top-8, 4096 tokens; 1% response share; 4k and 16k packs).
Every variant is warmed up once, then timed as the minimum over `--reps` interleaved repetitions; the machine may
be shared, so ratios are noisy.
"""

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def interleaved_min(fns: dict, reps: int, device) -> dict:
    best = {k: math.inf for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            best[name] = min(best[name], timed(fn, device))
    return best


# --- (a) MoE ----------------------------------------------------------------------------------------------
def bench_moe(args, device):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    from specdistill.kernels.moe import SparseMoeBlock

    tokens = 1024 if args.quick else 4096
    cfg = Qwen3NextConfig(hidden_size=512, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
                          shared_expert_intermediate_size=512, norm_topk_prob=True)
    torch.manual_seed(0)
    hf = Qwen3NextSparseMoeBlock(cfg)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.02)
    hf_fp32 = hf.to(device)
    cfg_g = Qwen3NextConfig(**cfg.to_dict())
    cfg_g._experts_implementation = "grouped_mm"
    hf_grouped = Qwen3NextSparseMoeBlock(cfg_g).to(device, torch.bfloat16)
    hf_grouped.load_state_dict(hf.state_dict())
    hf_fp32.experts.config._experts_implementation = "eager"
    hf_bf16 = Qwen3NextSparseMoeBlock(Qwen3NextConfig(**cfg.to_dict())).to(device, torch.bfloat16)
    hf_bf16.load_state_dict(hf.state_dict())
    hf_bf16.experts.config._experts_implementation = "eager"
    ours = SparseMoeBlock.from_config(cfg).to(device, torch.bfloat16)
    ours.load_state_dict(hf.state_dict())

    x32 = torch.randn(1, tokens, 512, device=device)
    g32 = torch.randn_like(x32)

    def step(model, dtype):
        def run():
            x = x32.to(dtype).requires_grad_()
            model(x).backward(g32.to(dtype))
        return run

    fns = {"transformers_eager_fp32": step(hf_fp32, torch.float32),
           "transformers_eager_bf16": step(hf_bf16, torch.bfloat16),
           "transformers_grouped_mm_bf16": step(hf_grouped, torch.bfloat16),
           "ours_bf16": step(ours, torch.bfloat16)}
    for fn in fns.values():  # warm-up, the same for every variant (allocator, oneDNN primitives)
        fn()
    t = interleaved_min(fns, args.reps, device)
    for k, v in t.items():
        print(f"moe {k}: {v:.3f} s (tokens={tokens}, best of {args.reps})")
    return {"moe_grouped_speedup": t["transformers_eager_fp32"] / t["ours_bf16"],
            "moe_vs_eager_bf16": t["transformers_eager_bf16"] / t["ours_bf16"],
            "moe_vs_transformers_grouped": t["transformers_grouped_mm_bf16"] / t["ours_bf16"]}


# --- (b) response-only logits memory ------------------------------------------------------------------------
def logits_worker(variant: str, T: int, V: int, D: int, device: torch.device) -> int:
    """Peak bytes above the state before the loss stage (inputs, lm_heads), fwd + bwd of KL(target || draft)."""
    from specdistill.kernels.logits import chunked_kl, kl_reference

    torch.manual_seed(0)
    hidden = torch.randn(T, D, device=device, requires_grad=True)
    target_hidden = torch.randn(T, D, device=device)
    weight = torch.randn(V, D, device=device) * 0.05
    loss_mask = torch.zeros(T, dtype=torch.bool, device=device)
    loss_mask[torch.randperm(T)[: max(1, T // 100)]] = True  # 1% response share
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:  # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS
        Path("/proc/self/clear_refs").write_text("5")
        base = _proc_status_bytes("VmRSS")
    if variant == "full":  # the naive trainer: logits for the whole pack, loss masked afterwards
        kl_T = kl_reference(hidden, weight, target_hidden, weight)
        loss = (kl_T * loss_mask).sum() / loss_mask.sum()
    else:
        kl_M = chunked_kl(hidden[loss_mask], weight, target_hidden[loss_mask], weight)
        loss = kl_M.mean()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return _proc_status_bytes("VmHWM") - base


def _proc_status_bytes(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def bench_logits(args, device):
    T, V, D = (2048, 16384, 256) if args.quick else (4096, 32768, 256)
    peaks = {}
    for variant in ("full", "response_only"):
        out = subprocess.run([sys.executable, __file__, "--logits-worker", variant, str(T), str(V), str(D),
                              "--device", device.type], capture_output=True, text=True, check=True)
        peaks[variant] = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
        print(f"logits {variant}: peak {peaks[variant] / 2**20:.1f} MiB (T={T}, V={V}, D={D}, M={max(1, T // 100)})")
    return {"response_logits_memory_ratio": max(peaks["response_only"], 1) / peaks["full"]}


# --- (c) attention -----------------------------------------------------------------------------------------
def workload_pack(T: int, generator: torch.Generator, response: int = 45):
    """Documents as the workload: prompts of 1k-5k tokens + a 45-token response (loss) at the end."""
    doc, mask, i = [], [], 0
    while sum(map(len, doc)) < T:
        L = int(torch.randint(1000, 5000, (1,), generator=generator)) + response
        doc.append(torch.full((L,), i))
        mask.append(torch.arange(L) >= L - response)
        i += 1
    return torch.cat(doc)[:T], torch.cat(mask)[:T]


def bench_attention(args, device):
    from specdistill.kernels.attention import anchor_block_plan, packed_causal_plan

    H, H_kv, d, B, W = 4, 2, 64, 8, 2048
    fast_impl = "flex" if device.type == "cuda" else "chunked"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ratios, causal_ratios = [], []
    for T in (4096, 16384):
        gen = torch.Generator().manual_seed(T)
        doc, mask = workload_pack(T, gen)
        anchors = torch.nonzero(mask).squeeze(-1)[:1024].to(device)
        doc = doc.to(device)
        Q = anchors.numel() * B
        q = torch.randn(H, Q, d, device=device, dtype=dtype, requires_grad=True)
        kv = [torch.randn(H_kv, T + Q, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2)]
        g = torch.randn(Q, H, d, device=device, dtype=dtype)
        plans = {impl: anchor_block_plan(doc, anchors, B, W, impl=impl) for impl in ("reference", fast_impl)}
        fns = {k: (lambda p=p: torch.autograd.grad(p(q, *kv, d**-0.5), (q, *kv), g)) for k, p in plans.items()}
        for fn in fns.values():
            fn()
        t = interleaved_min(fns, args.reps, device)
        ratios.append(t["reference"] / t[fast_impl])
        print(f"attention anchor_block T={T} N={anchors.numel()}: dense {t['reference']:.3f} s, "
              f"{fast_impl} {t[fast_impl]:.3f} s, x{ratios[-1]:.2f}")
        if T > 4096 and device.type == "cpu":  # the dense [16k, 16k] causal reference alone takes ~1 min here
            continue
        qc, kc, vc = (torch.randn(H if i == 0 else H_kv, T, d, device=device, dtype=dtype, requires_grad=True)
                      for i in range(3))
        gc = torch.randn(T, H, d, device=device, dtype=dtype)
        cplans = {impl: packed_causal_plan(doc, W, impl=impl) for impl in ("reference", fast_impl)}
        fns = {k: (lambda p=p: torch.autograd.grad(p(qc, kc, vc, d**-0.5), (qc, kc, vc), gc)) for k, p in cplans.items()}
        for fn in fns.values():
            fn()
        t = interleaved_min(fns, args.reps, device)
        causal_ratios.append(t["reference"] / t[fast_impl])
        print(f"attention packed_causal T={T}: dense {t['reference']:.3f} s, {fast_impl} {t[fast_impl]:.3f} s, "
              f"x{causal_ratios[-1]:.2f}")
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"attention packed_causal speedup (geomean): {math.exp(sum(map(math.log, causal_ratios)) / len(causal_ratios)):.2f}")
    return {"attention_cpu_speedup": geo}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (MoE 1024 tokens, no 16k causal)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip", default="", help="comma list of moe,logits,attention")
    ap.add_argument("--logits-worker", nargs=4, metavar=("VARIANT", "T", "V", "D"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.logits_worker:
        variant, T, V, D = args.logits_worker
        print(json.dumps({"peak_bytes": logits_worker(variant, int(T), int(V), int(D), device)}))
        return
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}")
    results, skip = {}, set(filter(None, args.skip.split(",")))
    for name, fn in (("moe", bench_moe), ("logits", bench_logits), ("attention", bench_attention)):
        if name not in skip:
            results.update(fn(args, device))
    label = "attention_gpu_speedup" if device.type == "cuda" else "attention_cpu_speedup"
    for key in ("moe_grouped_speedup", "moe_vs_eager_bf16", "moe_vs_transformers_grouped", "response_logits_memory_ratio",
                "attention_cpu_speedup"):
        if key in results:
            print(f"{label if key == 'attention_cpu_speedup' else key}: {results[key]:.3f}")


if __name__ == "__main__":
    main()
