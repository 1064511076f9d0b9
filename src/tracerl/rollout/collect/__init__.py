"""Collection: attempts played against environments, recorded as traces.

``collector`` (the entry point), ``attempt`` (one attempt's turns), ``batching`` (generation
requests batched across attempts), ``chat_tokens`` (the conversation rendered as tokens),
``compaction`` (summaries that continue an attempt in a fresh context), ``progress`` and
``ray_backend`` (environments and the policy in Ray actors).
"""
