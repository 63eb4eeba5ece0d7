"""specdistill: train speculative-decoding drafters by online distillation from a target LLM."""
