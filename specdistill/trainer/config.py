"""Trainer settings: the single place their defaults are stated (specdistill/conf/trainer/*.yaml only overrides)."""

from dataclasses import dataclass


@dataclass
class TrainerConfig:
    max_steps: int = 200  # bounds a run; epochs repeat the data until then
    max_epochs: int = 100
    token_budget: int = 4096  # tokens per packed sequence (32768 per GPU in production)
    grad_accum: int = 1  # packs per optimizer step and rank (global batch = ranks x grad_accum packs)
    prefetch_steps: int = 2  # optimizer steps' worth of packs extracted and packed ahead of the step (specdistill/trainer/feed.py)
    # CPU threads of each trainer rank; None: on CPU, the node's cores split over its ranks (specdistill/trainer/layout.py
    # cpu_threads); on CUDA, torch's default.
    threads: int | None = None
    lr: float = 3e-3  # AdamW (norms, biases, vectors; token tables, vocabulary heads, dynamic gates)
    muon_lr: float = 0.02  # torch.optim.Muon for 2-D weight matrices
    # hidden: Muon for hidden-layer matrices, AdamW for the drafter's token tables, vocabulary heads and dynamic
    # gates (Drafter.adamw_matrices; docs/quality.md "Muon on tables, heads and gates") | all: Muon for every 2-D
    # parameter (the behaviour before; an ablation)
    muon_scope: str = "hidden"
    weight_decay: float = 0.0
    warmup_steps: int = 10
    final_lr_fraction: float = 0.1  # linear decay to lr * this at max_steps
    grad_clip: float = 1.0
    precision: str = "auto"  # auto | fp32 | bf16 (bf16 autocast over fp32 master weights)
    device: str = "auto"  # auto | cpu | cuda
    ranks: int = 2  # trainer processes per node (torchrun --nproc-per-node); specdistill.launch.train starts them
    parallel: str = "ddp"  # ddp (replicated weights) | fsdp (FSDP2: weights, grads, optimizer states sharded)
    collective_timeout_s: int = 1800  # a rank stuck this long in a collective fails (naming it) instead of hanging
    seed: int = 0
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 10
    eval_rows: int = 64  # held-out rows for tau_offline and validation (0 = all); as many training rows are probed
    probe_rows: int | None = None  # training rows walked beside them (the overfitting gap); None: as many, 0: none
    # Held-out acceptance every N steps (specdistill/trainer/validation.py); 0 = at the end only; None = 5 points per run
    # (max_steps // 5, at most every 500 steps). An N above max_steps is an error.
    eval_every: int | None = None
    export: str = "best"  # best: the weights with the best held-out tau | last: the final weights
    feature_ablation: str = "none"  # none | zero | shuffle: the drafter's target states taken away (specdistill/trainer/ablation.py)
    compile: bool = False  # torch.compile the drafter (GPU)
    # Packs laid out over token_budget and attention query blocks padded to buckets, so compiled attention sees a few
    # fixed shapes (specdistill/core/shapes.py); None: on CUDA only (CPU runs nothing compiled), True: on CPU too.
    pad_packs: bool | None = None
    # read: drafters compute only the positions a loss, metric or served draft reads | all: every position of the
    # pack (the reference; equal losses and gradients, tests/drafters/test_compute_read.py). specdistill/drafters/base.py
    compute: str = "read"
    progress: bool = True
