"""Fixtures for tests and benchmarks: a toy tool-calling policy and scripted policies.

``toy_agent`` (a tiny model fitted in seconds to call tools, for plumbing tests) and
``scripted`` (a policy that replays fixed tool calls through the real collector). Nothing in
the library imports this package.
"""
