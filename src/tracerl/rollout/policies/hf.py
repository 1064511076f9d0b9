"""A local policy over any transformers causal LM: batched sampling with true behavior logprobs.

``HFPolicy.generate`` runs one lean decoding loop per batch: a single forward per step with a
KV cache, sampling in a handful of tensor ops (``rollout.policies.sampling.processed_logprobs`` and an
exponential race), and no logits-processor objects. That loop, not the model, is most of the
cost of ``model.generate`` for small models, which is why this exists (see ``bench/sampling.py``).
For Llama-architecture models (Llama, Qwen2, Mistral without sliding window) the forward itself
is replaced by ``rollout.policies.fused_llama``: packed projections, a preallocated cache and
``scaled_dot_product_attention``, the same logits to float rounding; other models, or
``decode="hf"``, use the transformers forward. On the fused path a prompt that extends an
earlier call's row (a conversation's next turn) is prefilled from that row's kept keys and
values (``rollout.policies.prefix_cache``), emptied whenever the weights change.

Accounting: each sampled token's logprob is recorded under the distribution it was drawn from
(temperature, top-k, top-p, renormalised), and every completion carries the ``policy_version``
that sampled it. ``rollout.policies.sampling.sequence_logprobs`` with the same params reproduces those
numbers from a single forward pass over prompt + completion.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from tracerl.rollout.decoding.constraints import TokenConstraint, apply_constraints
from tracerl.rollout.policies.fused_decoder import FusedLlamaDecoder
from tracerl.rollout.policies.fused_llama import (
    PackedLlama,
    pack_llama,
    unsupported_reason,
)
from tracerl.rollout.policies.prefix_cache import PrefixCache
from tracerl.rollout.policies.sampling import (
    Completion,
    FinishReason,
    SamplingParams,
    processed_logprobs,
)

CacheKind = Literal["auto", "static", "dynamic"]
"""KV cache: ``"static"`` preallocates prompt + new tokens once (no per-step copies);
``"dynamic"`` grows by concatenation and works for every model; ``"auto"`` picks static when
the model declares support for it. Used by the transformers decode path only."""

DecodeKind = Literal["auto", "fused", "hf"]
"""Which forward decodes: ``"fused"`` is ``rollout.policies.fused_llama`` (Llama-architecture models
only; ValueError otherwise); ``"hf"`` is the model's own forward with a transformers cache;
``"auto"`` is fused when the model qualifies and no cache kind was named explicitly."""


def _model_context_length(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class HFPolicy:
    """Batched sampler over a transformers ``AutoModelForCausalLM`` and its tokenizer.

    The model is used as is (shared with a trainer if you like): ``generate`` switches it to eval
    mode under ``torch.inference_mode`` and restores its training flag afterwards. Bump
    ``policy_version`` after every weight update so that samples are stamped correctly.
    """

    engine: str = "hf"
    """Engine name stamped on the segments this policy produces."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        policy_version: int = 0,
        max_batch_size: int = 64,
        cache: CacheKind = "auto",
        decode: DecodeKind = "auto",
        prefix_cache_bytes: int = 256 * 2**20,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if cache not in ("auto", "static", "dynamic"):
            raise ValueError(f"cache must be 'auto', 'static' or 'dynamic', got {cache!r}")
        if decode not in ("auto", "fused", "hf"):
            raise ValueError(f"decode must be 'auto', 'fused' or 'hf', got {decode!r}")
        if decode == "fused":
            reason = unsupported_reason(model)
            if reason is not None:
                raise ValueError(f"decode='fused' is not supported by {type(model).__name__}: {reason}")
        self.decode_mode: DecodeKind = decode
        """The decode path asked for (see ``DecodeKind``); ``decode_path()`` says which runs."""
        # Naming a transformers cache kind is asking for the transformers path.
        self._fused_allowed = decode == "fused" or (decode == "auto" and cache == "auto")
        self.model = model
        self.tokenizer = tokenizer
        self.policy_version: int = policy_version
        """Version of the weights; the trainer increments it after each update."""
        self.max_batch_size = max_batch_size
        self.context_length: int | None = _model_context_length(model)
        """Longest sequence (prompt + completion) the model accepts; None if it declares none."""
        # A LoRA wrapper (peft) passes these keywords on to the model under it.
        inner: Any = getattr(model, "get_base_model", lambda: model)()
        forward_params = inspect.signature(inner.forward).parameters
        # transformers 5 renamed ``past_key_values`` to ``cache``; accept either.
        self._cache_arg = "cache" if "cache" in forward_params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in forward_params
        supports_static = bool(getattr(model, "_can_compile_fullgraph", False))
        if cache == "static" and not supports_static:
            raise ValueError(f"cache='static' is not supported by {type(model).__name__}")
        self._static = supports_static if cache == "auto" else cache == "static"
        self._pad_id = self._first_id(getattr(tokenizer, "pad_token_id", None), default=0)
        self._eos_ids = self._eos_token_ids()
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        """Keys and values of earlier calls' rows (fused path; ``rollout.policies.prefix_cache``): a
        prompt that extends one (a conversation's next turn) computes only its new tokens.
        ``prefix_cache_bytes=0`` turns it off."""

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The tokens that end a completion when ``SamplingParams.stop_token_ids`` is None."""
        return self._eos_ids

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> HFPolicy:
        """Load a local directory (or a hub name, if the caller allows downloads) in float32;
        a directory holding a LoRA adapter loads its base with the adapter merged in."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tracerl.models.lora import is_adapter_dir

        if is_adapter_dir(path):
            from tracerl.models.tiny import load_tiny

            return cls(*load_tiny(path), **kwargs)

        tokenizer = AutoTokenizer.from_pretrained(path)
        from tracerl.models.weights import check_finite_weights

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        check_finite_weights(model, path)
        return cls(model, tokenizer, **kwargs)

    # ----------------------------------------------------------------- prompts and text

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the tokenizer's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {type(self.tokenizer).__name__} has no chat template; pass token ids "
                "to generate() or set tokenizer.chat_template"
            )
        ids = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        return [int(i) for i in ids]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` without special tokens, as ``Completion.text`` is made."""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    # ----------------------------------------------------------------- generation

    def decode_path(self) -> Literal["fused", "hf"]:
        """The forward the next ``generate()`` uses, checked against the model as it is now.

        A model that stops qualifying (a LoRA wrapper or hook added after this policy was built)
        falls back to ``"hf"`` under ``decode="auto"`` and raises ValueError under ``"fused"``.
        """
        if not self._fused_allowed:
            return "hf"
        reason = unsupported_reason(self.model)
        if reason is None:
            return "fused"
        if self.decode_mode == "fused":
            raise ValueError(f"decode='fused' is not supported by {type(self.model).__name__}: {reason}")
        return "hf"

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        row_seeds: Sequence[int] | None = None,
        constraints: Sequence[TokenConstraint | None] | None = None,
    ) -> list[Completion]:
        """Sample one completion per prompt (token ids), in the order given.

        Args:
            prompts: token ids of each prompt (already chat-formatted if needed).
            params: sampling parameters shared by all prompts.
            row_seeds: optional seed per prompt. With it, each prompt's tokens come from its own
                generator, so a prompt's completion does not depend on which other prompts share
                its batch (up to float rounding of batched matrix products). Without it, one
                generator seeded by ``params.seed`` serves the whole call.
            constraints: optional rule per prompt (``rollout.decoding.constraints``; None for none):
                before each token the row's completion so far is decoded and the rule's mask
                applied, and the recorded logprob is the masked distribution's (greedy rows
                take the masked arg-max).
        """
        prompt_lists = self._check_prompts(prompts)
        if row_seeds is not None and len(row_seeds) != len(prompt_lists):
            raise ValueError(
                f"row_seeds has {len(row_seeds)} seeds for {len(prompt_lists)} prompts"
            )
        if constraints is not None and len(constraints) != len(prompt_lists):
            raise ValueError(
                f"constraints has {len(constraints)} rules for {len(prompt_lists)} prompts"
            )
        if params.seed is not None:
            seed = params.seed
        else:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        shared = torch.Generator(device="cpu").manual_seed(seed)
        stop_ids = self._eos_ids if params.stop_token_ids is None else params.stop_token_ids
        fused = self.decode_path() == "fused"
        results: list[Completion] = []
        was_training = self.model.training
        if not fused:  # the fused path has no dropout: no mode to switch
            self.model.eval()
        try:
            with torch.inference_mode():
                # Packed from the weights as they are now: a trainer's update is always seen.
                packed = pack_llama(self.model, check=False) if fused else None
                if fused:  # and keys and values of other weights are never reused
                    self.prefix_cache.check_weights(self._weights_identity())
                for start in range(0, len(prompt_lists), self.max_batch_size):
                    chunk = prompt_lists[start : start + self.max_batch_size]
                    generators: list[torch.Generator] | torch.Generator = shared
                    if row_seeds is not None:
                        generators = [
                            torch.Generator(device="cpu").manual_seed(int(s))
                            for s in row_seeds[start : start + self.max_batch_size]
                        ]
                    rules = (None if constraints is None
                             else list(constraints[start : start + self.max_batch_size]))
                    results.extend(
                        self._generate_batch(chunk, params, stop_ids, generators, packed, rules)
                    )
        finally:
            if not fused:
                self.model.train(was_training)
        return results

    def _generate_batch(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stop_ids: tuple[int, ...],
        generators: list[torch.Generator] | torch.Generator,
        packed: PackedLlama | None,
        constraints: list[TokenConstraint | None] | None = None,
    ) -> list[Completion]:
        device = self._device()
        n_rows = len(prompts)
        lengths = [len(p) for p in prompts]
        prompt_width = max(lengths)
        # Each row may generate up to max_new_tokens, but never past the model's context.
        budgets = [
            params.max_new_tokens
            if self.context_length is None
            else min(params.max_new_tokens, self.context_length - n)
            for n in lengths
        ]
        n_steps = max(budgets)
        if n_steps <= 0:
            return [self._completion([], [], "length", None) for _ in prompts]

        input_ids = torch.full((n_rows, prompt_width), self._pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((n_rows, prompt_width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: real tokens end at the same column
            input_ids[row, prompt_width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[row, prompt_width - len(prompt) :] = 1
        input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
        position_ids = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
        total_width = prompt_width + n_steps
        decoder: FusedLlamaDecoder | _HFDecoder
        reuse = packed is not None and self.prefix_cache.max_bytes > 0
        if packed is not None:
            # Identical prompts (a group's G samples) are prefilled once; the cache is copied.
            first_row: dict[tuple[int, ...], int] = {}
            for row, prompt in enumerate(prompts):
                first_row.setdefault(tuple(prompt), row)
            past = self._past(list(first_row)) if reuse else None
            if len(first_row) < n_rows:
                at = torch.tensor(list(first_row.values()), dtype=torch.long, device=device)
                slot = {key: i for i, key in enumerate(first_row)}
                copies = torch.tensor([slot[tuple(p)] for p in prompts], dtype=torch.long,
                                      device=device)
                decoder = FusedLlamaDecoder(packed, len(first_row), total_width)
                logits = decoder.prefill(input_ids[at], prompt_mask[at], position_ids[at],
                                         past=past)
                decoder.repeat_rows(copies)
                logits = logits[copies]
            else:
                decoder = FusedLlamaDecoder(packed, n_rows, total_width)
                logits = decoder.prefill(input_ids, prompt_mask, position_ids, past=past)
        else:
            decoder = _HFDecoder(self, n_steps, total_width)
            logits = decoder.prefill(input_ids, prompt_mask, position_ids)
        next_position = position_ids[:, -1:] + 1

        out_tokens = torch.full((n_rows, n_steps), self._pad_id, dtype=torch.long)
        out_logprobs = torch.zeros((n_rows, n_steps), dtype=torch.float32)
        n_generated = [0] * n_rows
        finish: list[FinishReason | None] = [None] * n_rows
        stop_reason: list[int | str | None] = [None] * n_rows
        rows = list(range(n_rows))  # original row index of each batch row
        budget_left = torch.tensor(budgets)
        stop_tensor = torch.tensor(stop_ids, dtype=torch.long)
        max_stop_len = max((len(s) for s in params.stop_strings), default=0)
        checked_text_len = [0] * n_rows

        constrained = constraints is not None and any(c is not None for c in constraints)
        for step in range(n_steps):
            if constrained:
                assert constraints is not None
                # Finished rows still in the batch need no mask: their tokens are dropped.
                masks = [self._allowed(constraints[r], out_tokens[r, :step])
                         if finish[r] is None else None for r in rows]
                logits = apply_constraints(logits, masks)
            tokens, token_logprobs = self._sample(logits, params, generators, rows)
            tokens_cpu, logprobs_cpu = tokens.cpu(), token_logprobs.cpu()
            live = [r for r in rows if finish[r] is None]
            batch_index = {r: i for i, r in enumerate(rows)}
            live_idx = torch.tensor([batch_index[r] for r in live], dtype=torch.long)
            live_t = torch.tensor(live, dtype=torch.long)
            out_tokens[live_t, step] = tokens_cpu[live_idx]
            out_logprobs[live_t, step] = logprobs_cpu[live_idx]
            hit_stop = torch.isin(tokens_cpu[live_idx], stop_tensor).tolist()
            out_of_budget = (budget_left[live_t] <= step + 1).tolist()
            for j, r in enumerate(live):
                n_generated[r] = step + 1
                if hit_stop[j]:
                    finish[r], stop_reason[r] = "stop", int(tokens_cpu[batch_index[r]])
                elif params.stop_strings:
                    text = self.decode(out_tokens[r, : step + 1].tolist())
                    # Only text that could contain a new match is searched.
                    window = text[max(0, checked_text_len[r] - max_stop_len + 1) :]
                    checked_text_len[r] = len(text)
                    found = [s for s in params.stop_strings if s in window]
                    if found:
                        finish[r], stop_reason[r] = "stop", found[0]
                if finish[r] is None and out_of_budget[j]:
                    finish[r] = "length"
            live = [r for r in rows if finish[r] is None]
            if not live or step == n_steps - 1:
                break
            if len(live) * 2 <= len(rows):
                # Finished rows stop costing compute: keep only live rows once they are half the
                # batch or fewer (at most log2(batch) re-indexings per call).
                keep = torch.tensor([batch_index[r] for r in live], dtype=torch.long, device=device)
                if reuse:
                    assert isinstance(decoder, FusedLlamaDecoder)
                    for i, r in enumerate(rows):
                        if finish[r] is not None:
                            self._keep_row(decoder, i, prompts[r], out_tokens[r, : n_generated[r]])
                if decoder.select_rows(keep):
                    rows = live
                    tokens = tokens[keep]
                    next_position = next_position[keep]
            logits = decoder.step(tokens, next_position)
            next_position = next_position + 1
        if reuse:
            assert isinstance(decoder, FusedLlamaDecoder)
            for i, r in enumerate(rows):
                self._keep_row(decoder, i, prompts[r], out_tokens[r, : n_generated[r]])

        completions = []
        for r in range(n_rows):
            n = n_generated[r]
            reason = finish[r] or "length"
            completions.append(
                self._completion(
                    out_tokens[r, :n].tolist(), out_logprobs[r, :n].tolist(), reason, stop_reason[r]
                )
            )
        return completions

    def _past(self, prompts: list[tuple[int, ...]]) -> list[torch.Tensor | None] | None:
        """Stored keys and values for each prompt's longest cached prefix (None: none found)."""
        found = [self.prefix_cache.find(p) for p in prompts]
        if all(entry is None for entry in found):
            return None
        return [None if entry is None else entry[1] for entry in found]

    def _keep_row(self, decoder: FusedLlamaDecoder, row: int, prompt: list[int],
                  generated: torch.Tensor) -> None:
        """Store ``row``'s keys and values: its prompt and every sampled token but the last
        (which was never fed to the model)."""
        tokens = [*prompt, *generated[:-1].tolist()]
        self.prefix_cache.put(tokens, decoder.row_cache(row, len(tokens)))

    def _weights_identity(self) -> tuple[Any, ...]:
        # ``_version`` counts in-place writes (optimizer steps, load_state_dict's copies).
        return (id(self.model), tuple((id(p), p._version) for p in self.model.parameters()))

    def _allowed(self, rule: TokenConstraint | None, generated: torch.Tensor) -> torch.Tensor | None:
        """The mask ``rule`` sets for the next token after ``generated`` (None: no rule)."""
        return None if rule is None else rule.allowed(self.decode(generated.tolist()))

    def _sample(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        generators: list[torch.Generator] | torch.Generator,
        rows: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per batch row; return it and its logprob under the sampled distribution."""
        if params.greedy:
            tokens = logits.argmax(dim=-1)
            return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
        logprobs = processed_logprobs(
            logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p
        )  # (B, V)
        # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i.
        if isinstance(generators, torch.Generator):
            noise = torch.empty(logprobs.shape, dtype=torch.float32).exponential_(
                generator=generators
            )
        else:
            noise = torch.stack(
                [
                    torch.empty(logprobs.shape[-1], dtype=torch.float32).exponential_(
                        generator=generators[r]
                    )
                    for r in rows
                ]
            )
        noise = noise.to(logprobs.device)
        tokens = (logprobs.exp() / noise).argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    # ----------------------------------------------------------------- model plumbing

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        *,
        prefill: bool,
    ) -> torch.Tensor:
        """Logits ``(B, V)`` for the last position of ``input_ids``."""
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "use_cache": True,
        }
        kwargs[self._cache_arg] = cache
        if prefill and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        output = self.model(**kwargs)
        return output.logits[:, -1, :]

    def _new_cache(self, width: int) -> Any:
        from transformers import DynamicCache

        config: Any = getattr(self.model, "config", None)
        if self._static:
            from transformers import StaticCache

            return StaticCache(config=config, max_cache_len=width)
        try:
            return DynamicCache(config=config)
        except TypeError:  # transformers 4.x: no config argument
            return DynamicCache()

    @staticmethod
    def _select_cache_rows(cache: Any, keep: torch.Tensor) -> bool:
        """Keep only batch rows ``keep`` of every cached key/value; False if the cache is opaque."""
        layers = getattr(cache, "layers", None)
        if layers is None:
            return False
        for layer in layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                return False
        for layer in layers:
            layer.keys = layer.keys.index_select(0, keep)
            layer.values = layer.values.index_select(0, keep)
            if hasattr(layer, "batch_size"):
                layer.batch_size = int(keep.numel())
        return True

    def _device(self) -> torch.device:
        try:
            return next(self.model.parameters()).device
        except StopIteration:
            return torch.device("cpu")

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of token-id lists (use chat_prompt for text)")
        if not prompts:
            raise ValueError("prompts is empty")
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        checked: list[list[int]] = []
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, (str, bytes)):
                raise ValueError(f"prompt {index} is a string; pass token ids (see chat_prompt)")
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompt {index} is empty; it needs at least one token")
            if self.context_length is not None and len(ids) > self.context_length:
                raise ValueError(
                    f"prompt {index} has {len(ids)} tokens, more than the model's context of "
                    f"{self.context_length} tokens"
                )
            if vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
                raise ValueError(f"prompt {index} has token ids outside the vocabulary [0, {vocab})")
            checked.append(ids)
        return checked

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for source in (
            getattr(self.tokenizer, "eos_token_id", None),
            getattr(getattr(self.model, "generation_config", None), "eos_token_id", None),
        ):
            values = source if isinstance(source, (list, tuple)) else [source]
            ids.extend(int(v) for v in values if isinstance(v, int) and int(v) not in ids)
        return tuple(ids)

    @staticmethod
    def _first_id(value: Any, *, default: int) -> int:
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        return int(value) if isinstance(value, int) else default

    def _completion(
        self,
        token_ids: list[int],
        logprobs: list[float],
        finish_reason: FinishReason,
        stop_reason: int | str | None,
    ) -> Completion:
        return Completion(
            token_ids=tuple(token_ids),
            logprobs=tuple(logprobs),
            finish_reason=finish_reason,
            text=self.decode(token_ids),
            stop_reason=stop_reason,
            policy_version=self.policy_version,
        )


class _HFDecoder:
    """The model's own forward with a transformers cache: works for every causal LM."""

    def __init__(self, policy: HFPolicy, n_new: int, width: int) -> None:
        self.policy = policy
        self.n_new = n_new
        self.cache = policy._new_cache(width)
        self.attention_mask = torch.zeros(0, dtype=torch.long)

    def prefill(
        self, input_ids: torch.Tensor, prompt_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.policy._static:
            # A static cache attends over its full width; columns beyond the current step are
            # hidden by causality, so the mask marks only the left padding.
            self.attention_mask = torch.cat(
                [prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], self.n_new)], dim=1
            )
        else:
            self.attention_mask = prompt_mask
        return self.policy._forward(
            input_ids, self.attention_mask, position_ids, self.cache, prefill=True
        )

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.policy._static:
            mask = self.attention_mask
            self.attention_mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        return self.policy._forward(
            tokens.unsqueeze(1), self.attention_mask, positions, self.cache, prefill=False
        )

    def select_rows(self, keep: torch.Tensor) -> bool:
        if not self.policy._select_cache_rows(self.cache, keep):
            return False
        self.attention_mask = self.attention_mask[keep]
        return True
