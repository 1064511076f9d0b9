"""The built-in task suite: small Python functions with one bug each, in a train and a
held-out split that share no templates."""

from __future__ import annotations

from tracerl.envs.suite.generate import DEFAULT_COUNTS, generate_split, make_task
from tracerl.envs.suite.templates import FAMILIES, TEMPLATES, Split, Template

__all__ = ["DEFAULT_COUNTS", "FAMILIES", "TEMPLATES", "Split", "Template", "generate_split",
           "make_task"]
