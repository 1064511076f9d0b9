"""Evaluation: fixed-budget success on hidden tests, costs, fault recovery, hack audits, reports.

``eval`` imports nothing of ``train``: it reads what a run wrote (checkpoints, metrics,
traces) from disk, and the trainer calls its scoring functions, never the other way. See
``docs/evaluation.md``.
"""

from __future__ import annotations

from tracerl.eval.audit import HACK_KINDS, HackFlag, hack_flag, hack_flags, hack_summary
from tracerl.eval.stats import bootstrap_ci, paired_bootstrap_ci, pass_at_k, pass_at_k_table
from tracerl.eval.summary import hidden_passed, succeeded, summarize, visible_passed

__all__ = [
    "HACK_KINDS",
    "HackFlag",
    "bootstrap_ci",
    "hack_flag",
    "hack_flags",
    "hack_summary",
    "hidden_passed",
    "paired_bootstrap_ci",
    "pass_at_k",
    "pass_at_k_table",
    "succeeded",
    "summarize",
    "visible_passed",
]
