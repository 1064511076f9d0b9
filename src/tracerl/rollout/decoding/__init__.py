"""Decoding rules: what a policy may sample next.

``constraints`` (token masks applied before sampling, recorded with the behavior logprob) and
``grammar`` (the tool-call grammar built from the environment's tool schemas).
"""
