"""The fused decoder: prefill and per-token decode over packed Llama weights (``fused_llama``).

A preallocated key/value cache ``(layers, 2, B, H_kv, T_max, D)`` is written in place; rows of
mixed lengths are split into length groups so that attention does not run over the padding of
short rows (``length_groups``); identical prompts in one batch (a group's G samples) are
prefilled once and their cache rows copied (``FusedLlamaDecoder.repeat_rows``); a prefix
cached by an earlier call is prefilled from (``prefill(past=...)``, ``prefix_cache``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tracerl.rollout.policies.fused_llama import PackedLlama, rms_norm, rotate_half

GROUP_OVERHEAD_CELLS = 256
"""Cost of one more attention call, in cached (row, column) cells that it must save to pay."""


def length_groups(lengths: list[int], overhead: int = GROUP_OVERHEAD_CELLS) -> list[tuple[int, int]]:
    """Split rows sorted by ascending length into contiguous groups ``[(start, stop), ...]``.

    A group attends over as many columns as its longest row, so a batch of mixed lengths wastes
    the padding of its shorter rows; every extra group costs ``overhead`` cells. Minimises
    ``sum(rows_g * max_len_g) + overhead * n_groups`` exactly (dynamic programming, O(B^2)).
    """
    n = len(lengths)
    best = [0] + [0] * n
    cut = [0] * (n + 1)
    for stop in range(1, n + 1):
        # Sorted ascending, so the group [start, stop) has max length lengths[stop - 1].
        options = [best[a] + (stop - a) * lengths[stop - 1] + overhead for a in range(stop)]
        cut[stop] = min(range(stop), key=options.__getitem__)
        best[stop] = options[cut[stop]]
    groups, stop = [], n
    while stop > 0:
        groups.append((cut[stop], stop))
        stop = cut[stop]
    return groups[::-1]


class FusedLlamaDecoder:
    """Prefill and per-token decode of one batch over packed weights and a preallocated cache.

    ``prefill`` takes left-padded prompts; ``step`` appends one token per row; ``select_rows``
    drops finished rows from the batch. Logits are returned for the newest position only
    (``prefill(..., all_positions=True)`` returns every position, for tests).

    Padding costs bandwidth: reading cached keys and values is most of a decode step for a small
    model, and a left-padded batch of mixed prompt lengths is mostly padding for its short rows.
    So rows are kept internally sorted by prompt length and split into contiguous groups
    (``length_groups``); each group attends only from its longest prompt's first column. Inputs
    and logits stay in the caller's row order.
    """

    def __init__(
        self,
        packed: PackedLlama,
        batch_size: int,
        max_width: int,
        *,
        group_overhead: int | None = None,
    ) -> None:
        if batch_size < 1 or max_width < 1:
            raise ValueError(f"batch_size and max_width must be >= 1, got {batch_size}, {max_width}")
        if group_overhead is None:
            group_overhead = GROUP_OVERHEAD_CELLS
        if group_overhead < 0:
            raise ValueError(f"group_overhead must be >= 0, got {group_overhead}")
        self.packed = packed
        self.group_overhead = group_overhead
        """See ``length_groups`` (None: ``GROUP_OVERHEAD_CELLS``); 0 gives a group per distinct
        prompt length."""
        self.prompt_width = 0
        """Columns of the left-padded prompts."""
        self.max_width = max_width
        embed = packed.embed
        self.dtype, self.device = embed.dtype, embed.device
        self.kv = torch.zeros(
            (len(packed.layers), 2, batch_size, packed.n_kv_heads, max_width, packed.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.valid = torch.zeros((batch_size, max_width), dtype=torch.bool, device=self.device)
        """Which cache columns hold real tokens (False for left padding), internal row order."""
        self.width = 0
        """Cache columns written so far (same for every row: prompts are left-aligned to the end)."""
        self.order = torch.arange(batch_size, device=self.device)
        """Caller's row index of each internal row (internal rows sorted by prompt length)."""
        self.inverse = self.order
        """Internal row of each caller's row."""
        self.lengths: list[int] = []
        """Prompt length of each internal row (ascending)."""
        self.groups: list[tuple[int, int, int]] = []
        """``(start, stop, first_column)`` of each group of internal rows."""
        positions = torch.arange(max_width, dtype=torch.float32, device=self.device)
        freqs = positions[:, None] * packed.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * packed.attention_scaling).to(self.dtype)
        self._sin = (emb.sin() * packed.attention_scaling).to(self.dtype)
        self._gqa = packed.n_heads != packed.n_kv_heads

    def _regroup(self) -> None:
        self.groups = [
            (a, b, self.prompt_width - self.lengths[b - 1])
            for a, b in length_groups(self.lengths, self.group_overhead)
        ]

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        rows: tuple[int, int],
        groups: list[tuple[int, int, int, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``(b, S, hidden)``, for internal rows ``rows``.

        Writes cache columns ``[width, width + S)`` for those rows. ``groups`` splits the rows
        for attention: ``(start, stop, first_column, mask)`` relative to ``rows[0]``.
        """
        p = self.packed
        batch, seq = input_ids.shape
        start, end = self.width, self.width + seq
        if end > self.max_width:
            raise ValueError(f"cache holds {self.max_width} positions; {end} requested")
        h_q, h_kv, dim = p.n_heads, p.n_kv_heads, p.head_dim
        cos = self._cos[position_ids].unsqueeze(1)  # (b, 1, S, D)
        sin = self._sin[position_ids].unsqueeze(1)
        hidden = F.embedding(input_ids, p.embed)
        for index, w in enumerate(p.layers):
            x = rms_norm(hidden, w.input_norm, w.input_norm_eps)
            qkv = F.linear(x, w.qkv, w.qkv_bias).view(batch, seq, h_q + 2 * h_kv, dim).transpose(1, 2)
            # q and k rotate together (one set of ops); v is untouched.
            qk = rotate_half(qkv[:, : h_q + h_kv], cos, sin)
            cache = self.kv[index, :, rows[0] : rows[1]]
            cache[0, :, :, start:end] = qk[:, h_q:]
            cache[1, :, :, start:end] = qkv[:, h_q + h_kv :]
            parts = [
                F.scaled_dot_product_attention(
                    qk[a:b, :h_q],
                    cache[0, a:b, :, first:end],
                    cache[1, a:b, :, first:end],
                    attn_mask=mask,
                    enable_gqa=self._gqa,
                )
                for a, b, first, mask in groups
            ]
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            attn = attn.transpose(1, 2).reshape(batch, seq, h_q * dim)
            hidden = hidden + F.linear(attn, w.o, w.o_bias)
            x = rms_norm(hidden, w.post_norm, w.post_norm_eps)
            gate, up = F.linear(x, w.gate_up, w.gate_up_bias).split(p.intermediate, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, w.down, w.down_bias)
        return rms_norm(hidden, p.final_norm, p.final_norm_eps)

    def prefill(
        self,
        input_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        all_positions: bool = False,
        past: Sequence[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Run left-padded prompts ``(B, S)``; logits ``(B, V)`` of the last column.

        Each length group is one pass over only its own columns. With ``all_positions``, logits
        ``(B, S, V)`` of every column (zeros where a group did not compute: padding, and the
        columns ``past`` supplied).

        ``past[r]`` (None: nothing) holds the keys and values of row ``r``'s first ``P``
        tokens as ``row_cache`` returns them, ``(layers, 2, H_kv, P, D)`` with ``P`` below the
        row's length: a conversation's earlier turns, so that only the new tokens are computed.
        A group then runs from its longest new part, so a row whose new part is shorter
        recomputes its last cached tokens (same values, up to float rounding).
        """
        if self.width:
            raise ValueError("prefill must be the first call on a decoder")
        batch, width = input_ids.shape
        if batch != self.kv.shape[2]:
            raise ValueError(f"input_ids has {batch} rows, the cache {self.kv.shape[2]}")
        valid = prompt_mask.bool()
        lengths = valid.sum(dim=1)
        if not bool((valid[:, 1:] >= valid[:, :-1]).all()) or not bool(valid[:, -1].all()):
            raise ValueError("prompt_mask must be left padding: each row's real tokens end last")
        if past is not None and len(past) != batch:
            raise ValueError(f"past has {len(past)} entries for {batch} rows")
        self.order = torch.sort(lengths, stable=True).indices
        self.inverse = torch.argsort(self.order)
        self.lengths = lengths[self.order].tolist()
        self.prompt_width = width
        self._regroup()
        ids, valid, positions = input_ids[self.order], valid[self.order], position_ids[self.order]
        self.valid[:, :width] = valid
        cached = [0] * batch  # tokens supplied by ``past``, per internal row
        if past is not None:
            for internal, row in enumerate(self.order.tolist()):
                kv = past[row]
                if kv is None:
                    continue
                n = int(kv.shape[-2])
                if not 0 < n < self.lengths[internal]:
                    raise ValueError(f"past[{row}] holds {n} tokens of a {self.lengths[internal]}"
                                     "-token prompt: it must hold at least one and leave one")
                column = width - self.lengths[internal]
                self.kv[:, :, internal, :, column : column + n] = kv
                cached[internal] = n
        outputs = []
        for a, b, first in self.groups:
            keys = width - first
            seq = max(self.lengths[r] - cached[r] for r in range(a, b))  # new columns to compute
            start = width - seq
            # Query q (column start + q) sees key k (column first + k) for k <= q + keys - seq.
            causal = torch.ones((seq, keys), dtype=torch.bool, device=self.device).tril(keys - seq)
            # A padding query may see itself: a row with nothing to attend to would give NaN,
            # and NaN values in the cache would poison real queries even at zero weight.
            own = torch.zeros((seq, keys), dtype=torch.bool, device=self.device)
            own[torch.arange(seq), torch.arange(keys - seq, keys)] = True
            mask = (causal & (valid[a:b, None, first:] | own)).unsqueeze(1)  # (b, 1, seq, keys)
            self.width = start
            hidden = self._forward(
                ids[a:b, start:], positions[a:b, start:], (a, b), [(0, b - a, first, mask)]
            )
            if not all_positions:
                hidden = hidden[:, -1]
            elif start:
                hidden = torch.cat([hidden.new_zeros(b - a, start, hidden.shape[-1]), hidden], dim=1)
            outputs.append(hidden)
        self.width = width
        hidden = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return F.linear(hidden[self.inverse], self.packed.head, self.packed.head_bias)

    def row_cache(self, row: int, length: int) -> torch.Tensor:
        """A copy of the keys and values of the caller's row ``row``'s first ``length`` tokens
        (its prompt, then the tokens ``step`` fed), ``(layers, 2, H_kv, length, D)``: what
        ``prefill(past=...)`` takes for a later prompt that starts with those tokens."""
        internal = int(self.inverse[row])
        column = self.prompt_width - self.lengths[internal]
        if not 0 < length <= self.width - column:
            raise ValueError(f"row {row} has {self.width - column} cached tokens, "
                             f"{length} requested")
        return self.kv[:, :, internal, :, column : column + length].clone()

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append one token per row (``(B,)`` ids at ``(B, 1)`` positions); logits ``(B, V)``."""
        self.valid[:, self.width] = True
        end = self.width + 1
        groups = [(a, b, first, self.valid[a:b, None, None, first:end]) for a, b, first in self.groups]
        hidden = self._forward(
            tokens.view(-1, 1)[self.order], positions.view(-1, 1)[self.order],
            (0, self.kv.shape[2]), groups,
        )
        self.width = end
        return F.linear(hidden[self.inverse, -1], self.packed.head, self.packed.head_bias)

    def repeat_rows(self, index: torch.Tensor) -> None:
        """Make the caller's new row ``j`` a copy of old row ``index[j]`` (repeats allowed):
        prompts shared by several rows are prefilled once and their cache copied."""
        internal = self.inverse[index]  # old internal row of each new caller row
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=internal.device)[internal]
        order = torch.sort(lengths, stable=True).indices  # new internal row -> new caller row
        source = internal[order]
        kv = self.kv.new_zeros((*self.kv.shape[:2], source.numel(), *self.kv.shape[3:]))
        kv[..., : self.width, :] = self.kv[:, :, source, :, : self.width]
        self.kv = kv
        self.valid = self.valid[source]
        self.order = order
        self.inverse = torch.argsort(order)
        self.lengths = lengths[order].tolist()
        self._regroup()

    def select_rows(self, keep: torch.Tensor) -> bool:
        """Keep only the caller's rows ``keep`` (in that new order); copies written columns only."""
        self.repeat_rows(keep)
        return True
