"""Evaluate the weights the serving engine will run: the drafter and the target head cast to the export's dtype.

The trainer keeps fp32 master weights; vLLM serves the export in the target's dtype (specdistill/drafters/base.py
export_dtype), so held-out acceptance is measured on a copy in that dtype (training-time validation and the
benchmarks alike).
"""

import copy

import torch

from specdistill.drafters.base import export_dtype
from specdistill.evaluation.acceptance import evaluate_report


def serving_copy(drafter, head):
    """(drafter, head) in the export's dtype: evaluate the weights vLLM will serve, not the fp32 masters."""
    dtype = export_dtype(head.info)
    if dtype == torch.float32:
        return drafter, head
    return copy.deepcopy(drafter).to(dtype), copy.deepcopy(head).to(dtype)


def evaluate_as_served(drafter, head, samples, spec, device, **report_kwargs):
    """specdistill.evaluation.acceptance.evaluate_report with the drafter (and the target head) in the export's dtype;
    spec: what the samples ship (or layer ids: whole rows)."""
    served, served_head = serving_copy(drafter, head)
    return evaluate_report(served, served_head, samples, spec, device, export_dtype(head.info), **report_kwargs)
