"""tracerl: reinforcement learning for multi-turn LLM agents, with the accounting made explicit.

The core math is re-exported here (``from tracerl import gae``); everything else lives in its
subpackage and is imported on use.
"""

from __future__ import annotations

from tracerl.core import *  # noqa: F403  (the public core names, listed in tracerl.core.__all__)
from tracerl.core import __all__ as _core_all

__version__ = "0.1.0"

__all__ = [*_core_all, "__version__"]
