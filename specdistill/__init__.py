"""specdistill: train speculative-decoding drafters by online distillation from a target LLM."""

__version__ = "0.1.0"
