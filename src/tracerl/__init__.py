"""tracerl: reinforcement learning for multi-turn LLM agents, with the accounting made explicit."""

__version__ = "0.1.0"
