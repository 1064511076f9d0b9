"""The built-in task suite: small Python functions with one bug each, in a train and a
held-out split that share no templates.

Beside the generator (``generate``, ``compose``, ``templates``) are the suite's recipe parts:
``demonstrator`` (scripted, imperfect attempts at these tasks, played in the environment, that
the demo's warm start learns from) and ``augment`` (renamed copies of tasks: fresh function, module
and local names). The library that trains on demonstrations is ``tracerl.train.sft``.
"""

from __future__ import annotations

from tracerl.envs.suite.generate import DEFAULT_COUNTS, generate_split, make_task
from tracerl.envs.suite.templates import FAMILIES, TEMPLATES, Split, Template

__all__ = ["DEFAULT_COUNTS", "FAMILIES", "TEMPLATES", "Split", "Template", "generate_split",
           "make_task"]
