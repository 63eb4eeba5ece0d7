"""Everything about training data before the target sees it: row formats, the tokenized memory-mapped store,
selection to a pack size, pack planning, workloads and regeneration (docs/data.md)."""
