"""Serving: a local policy behind an OpenAI-compatible endpoint that records what it serves.

``server`` (the HTTP endpoint), ``requests`` (what a request asks for, checked) and
``recorder`` (per-session traces written to a store).
"""
