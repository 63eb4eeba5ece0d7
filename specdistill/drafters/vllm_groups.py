"""Will vLLM 0.32 place a drafter's layers in one KV-cache group next to its target? (docs/vllm.md, "KV-cache groups")

vLLM refuses a drafter whose attention layers land in more than one KV-cache group ("All drafting layers should
belong to the same kv cache group"). Groups are formed over target and drafter layers together: layers are
bucketed by cache spec, group_size is the smallest bucket (the largest when it is < 1.5x the smallest), and a
bucket of n layers is dealt round-robin into ceil(n / group_size) groups. A layer's spec here is its kind
("linear" for gated-DeltaNet state, "full", or ("sliding", window)) with the attention geometry (kv heads, head dim)
that decides whether two full-attention layers share a bucket.
"""

from collections import Counter
from collections.abc import Hashable, Sequence

LINEAR = ("linear",)


def attention_spec(kind: str, num_kv_heads: int, head_dim: int, window: int | None = None) -> tuple:
    if kind == "sliding":
        return ("sliding", window, num_kv_heads, head_dim)
    if kind == "full":
        return ("full", None, num_kv_heads, head_dim)
    raise ValueError(f"attention kind {kind!r}; valid: full, sliding")


def target_specs(layer_types: Sequence[str], num_kv_heads: int, head_dim: int, window: int | None = None) -> list:
    """Specs of a target's layers from its config's `layer_types` (transformers names)."""
    out = []
    for t in layer_types:
        if t == "linear_attention":
            out.append(LINEAR)
        elif t == "sliding_attention":
            out.append(attention_spec("sliding", num_kv_heads, head_dim, window))
        elif t == "full_attention":
            out.append(attention_spec("full", num_kv_heads, head_dim))
        else:
            raise ValueError(f"target layer type {t!r} is not one vLLM's KV-cache grouping is modelled for here")
    return out


def _uniform(specs: Sequence[Hashable]) -> bool:
    """vLLM's one-group cases: identical specs, or all full attention (any geometry), or one sliding window."""
    kinds = {s[:2] for s in specs}
    return len(set(specs)) == 1 or kinds == {("full", None)} or (len(kinds) == 1 and next(iter(kinds))[0] == "sliding")


def drafter_in_one_group(target: Sequence[Hashable], drafter: Sequence[Hashable]) -> bool:
    if len(drafter) <= 1 or _uniform([*target, *drafter]):
        return True
    if len(set(drafter)) > 1:  # different specs are different buckets, hence different groups
        return False
    buckets = Counter([*target, *drafter])
    lo, hi = min(buckets.values()), max(buckets.values())
    group_size = hi if hi < 1.5 * lo else lo
    return buckets[drafter[0]] <= group_size


def max_layers_in_one_group(target: Sequence[Hashable], spec: Hashable, limit: int = 64) -> int:
    """The most drafter layers of `spec` vLLM keeps in one group next to `target` (at least 1)."""
    return max(n for n in range(1, limit + 1) if drafter_in_one_group(target, [spec] * n))
