"""Policies: samplers that return tokens with their true behavior logprobs.

``hf`` (a local transformers model, with the ``fused_llama`` decoder and its ``prefix_cache``),
``openai_api`` (a vLLM or SGLang server), and ``sampling`` (the parameters every sampler
takes, and logprobs under the distribution actually sampled from).
"""
