"""Grammar-constrained decoding of tool calls: every action is one well-formed call.

Serving stacks offer this as structured output for function calling (vLLM's guided decoding
with ``tool_choice="required"``, OpenAI's ``strict`` tools, Outlines, XGrammar): the sampler
may only draw tokens that keep the text a prefix of a valid call. ``ToolCallGrammar`` is that
rule for the Hermes format the chat template renders (``models.tiny.render_tool_call``)::

    <tool_call>{"name": "replace", "arguments": {"line": 6, "old": "n + 1", "new": "n - 1"}}</tool_call>

The language is fixed by the tool schemas: the name is one of the tools; the arguments are
the tool's own properties, each at most once, in any order, with ``json.dumps``'s separators
(``", "`` and ``": "``); string values are JSON strings (escapes ``\\" \\\\ \\/ \\b \\f \\n
\\r \\t``; raw control characters, ``\\u`` escapes and the closing tag ``</tool_call>``,
where the environment's parser would end the call, are never drawn); integer values are 1 to
4 digits without a leading zero; the object closes only once the schema's required properties
(and one of each alternative pair, such as ``replace``'s ``old`` or ``line``) are given; after
``</tool_call>`` only an end-of-turn token may follow. What the call says (which tool, which
line, what text) stays the policy's choice; only text no parser would accept is removed.

How: the text so far is run through a small deterministic character machine whose states are
hashable tuples. The mask of a state is found once by walking a trie of the vocabulary's token
texts from it (a token is allowed when every character of it is) and cached for the run:
the 3,230 actions of a demo-sized run's evaluations passed through 150 distinct states at
token boundaries. Each row's rule (``ToolCallRule``) keeps its machine
state and advances it over the characters the row added since the last token.

Accounting is as for ``rollout.decoding.constraints``: the mask is part of the sampled distribution,
so the behavior logprob is the masked one; the trainer's old/new logprobs are the unmasked
policy's, and the gap is in ``mismatch.*``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tracerl.hermes import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

State = tuple[Any, ...]
"""A machine state: ``("lit", rest, then)`` (the literal ``rest`` must come, then state
``then``), ``("name", prefix)``, ``("args", tool, used, first)``, ``("key", tool, used, prefix)``,
``("str", tool, used, escaped, closing)``, ``("int", tool, used, digits)`` or ``("done",)``."""

_DONE: State = ("done",)
_ESCAPES = frozenset('"\\/bfnrt')
_MAX_DIGITS = 4


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the grammar sees it."""

    name: str
    """The tool's name."""
    properties: Mapping[str, str]
    """Argument name -> JSON type (``"string"`` or ``"integer"``)."""
    required: frozenset[str]
    """Arguments every call must give."""
    alternatives: tuple[tuple[str, ...], ...] = ()
    """Sets of arguments of which each call must give at least one."""

    def complete(self, used: frozenset[str]) -> bool:
        """Whether a call giving the arguments ``used`` may close."""
        return self.required <= used and all(used & set(group) for group in self.alternatives)


def tool_specs(schemas: Iterable[Mapping[str, Any]],
               alternatives: Mapping[str, Sequence[Sequence[str]]] | None = None
               ) -> tuple[ToolSpec, ...]:
    """``ToolSpec`` of each OpenAI-format function schema (``envs.tools.TOOL_SCHEMAS``).

    ValueError, naming the tool and argument, for a property type other than string and
    integer, or for a schema without a function name."""
    specs = []
    for schema in schemas:
        function = schema.get("function", schema)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"schemas: a tool schema has no function name: {schema!r}")
        parameters = function.get("parameters") or {}
        properties: dict[str, str] = {}
        for key, spec in (parameters.get("properties") or {}).items():
            kind = spec.get("type")
            if kind not in ("string", "integer"):
                raise ValueError(f"schemas: {name}.{key} has type {kind!r}; the tool-call "
                                 "grammar supports string and integer arguments")
            properties[key] = kind
        required = frozenset(parameters.get("required") or ())
        unknown = required - set(properties)
        if unknown:
            raise ValueError(f"schemas: {name} requires {sorted(unknown)}, which it does not "
                             "list as properties")
        groups = tuple(tuple(group) for group in (alternatives or {}).get(name, ()))
        specs.append(ToolSpec(name, properties, required, groups))
    if not specs:
        raise ValueError("schemas: no tool to call")
    return tuple(specs)


class _Trie:
    """The vocabulary's token texts as a character trie."""

    __slots__ = ("children", "ids")

    def __init__(self) -> None:
        self.children: dict[str, _Trie] = {}
        self.ids: list[int] = []

    def add(self, text: str, token_id: int) -> None:
        node = self
        for char in text:
            node = node.children.setdefault(char, _Trie())
        node.ids.append(token_id)


class ToolCallGrammar:
    """The language of one tool call, over one tokenizer's vocabulary (shared by all rows).

    Args:
        tools: the callable tools (``tool_specs``).
        tokenizer: the policy's tokenizer; special tokens are allowed only as ``end_ids``.
        width: the model's output width (ids past the tokenizer are never allowed).
        end_ids: the tokens that end a turn; allowed only after ``</tool_call>``.
    """

    def __init__(self, tools: Sequence[ToolSpec], tokenizer: Any, width: int,
                 end_ids: Sequence[int]) -> None:
        if not end_ids:
            raise ValueError("end_ids: the grammar needs at least one end-of-turn token")
        self.tools = {tool.name: tool for tool in tools}
        self.width = width
        self.end_ids = tuple(int(i) for i in end_ids)
        if any(not 0 <= i < width for i in self.end_ids):
            raise ValueError(f"end_ids: {self.end_ids} not all within the vocabulary of {width}")
        self.start: State = ("lit", TOOL_CALL_OPEN + '{"name": "', ("name", ""))
        self._trie = _Trie()
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        for token_id in range(min(len(tokenizer), width)):
            if token_id not in special:
                text = str(tokenizer.decode([token_id]))
                if text:
                    self._trie.add(text, token_id)
        self._masks: dict[State, torch.Tensor] = {}
        self._names = tuple(self.tools)

    # -- the character machine ---------------------------------------------------------------

    def advance(self, state: State | None, text: str) -> State | None:
        """The state after ``text`` from ``state``; None once the text leaves the language."""
        for char in text:
            if state is None:
                return None
            state = self.step(state, char)
        return state

    def step(self, state: State, char: str) -> State | None:
        """The state after one character, or None where it is not allowed."""
        kind = state[0]
        if kind == "lit":
            rest, then = state[1], state[2]
            if char != rest[0]:
                return None
            return then if len(rest) == 1 else ("lit", rest[1:], then)
        if kind == "name":
            prefix = state[1]
            if char == '"':
                if prefix in self.tools:
                    return ("lit", ', "arguments": {', ("args", prefix, frozenset(), True))
                return None
            grown = prefix + char
            return ("name", grown) if any(n.startswith(grown) for n in self._names) else None
        if kind == "args":
            tool, used, first = state[1], state[2], state[3]
            spec = self.tools[tool]
            if char == "}":
                return ("lit", "}" + TOOL_CALL_CLOSE, _DONE) if spec.complete(used) else None
            if first:
                return ("key", tool, used, "") if char == '"' and self._free(spec, used) else None
            if char == "," and self._free(spec, used):
                return ("lit", ' "', ("key", tool, used, ""))
            return None
        if kind == "key":
            tool, used, prefix = state[1], state[2], state[3]
            spec = self.tools[tool]
            if char == '"':
                if prefix not in spec.properties or prefix in used:
                    return None
                now = used | {prefix}
                if spec.properties[prefix] == "integer":
                    return ("lit", ": ", ("int", tool, now, 0))
                return ("lit", ': "', ("str", tool, now, False, 0))
            grown = prefix + char
            if any(k.startswith(grown) for k in spec.properties if k not in used):
                return ("key", tool, used, grown)
            return None
        if kind == "str":
            tool, used, escaped, closing = state[1], state[2], state[3], state[4]
            if escaped:
                return ("str", tool, used, False, 0) if char in _ESCAPES else None
            if char == "\\":
                return ("str", tool, used, True, 0)
            if char == '"':
                return ("args", tool, used, False)
            if ord(char) < 0x20:
                return None
            # The closing tag never appears inside a string: the environment's parser ends
            # the call at the first one. ``closing`` counts its characters matched so far
            # (its only "<" is its first character, so a mismatch restarts at 0 or 1).
            if char == TOOL_CALL_CLOSE[closing]:
                closing += 1
                return None if closing == len(TOOL_CALL_CLOSE) else ("str", tool, used, False,
                                                                      closing)
            return ("str", tool, used, False, 1 if char == "<" else 0)
        if kind == "int":
            tool, used, digits = state[1], state[2], state[3]
            if char.isdigit() and char.isascii():
                if (digits == 0 and char == "0") or digits >= _MAX_DIGITS:
                    return None
                return ("int", tool, used, digits + 1)
            if digits == 0:
                return None
            return self.step(("args", tool, used, False), char)
        return None  # done: no more text

    @staticmethod
    def _free(spec: ToolSpec, used: frozenset[str]) -> bool:
        return any(key not in used for key in spec.properties)

    # -- masks ---------------------------------------------------------------------------------

    def mask(self, state: State) -> torch.Tensor:
        """The tokens allowed next in ``state`` (bool over the output width), cached."""
        found = self._masks.get(state)
        if found is None:
            keep = torch.zeros(self.width, dtype=torch.bool)
            if state == _DONE:
                keep[list(self.end_ids)] = True
            else:
                allowed: list[int] = []
                self._walk(state, self._trie, allowed)
                keep[allowed] = True
            found = self._masks[state] = keep
        return found

    def _walk(self, state: State, node: _Trie, allowed: list[int]) -> None:
        for char, child in node.children.items():
            after = self.step(state, char)
            if after is not None:
                allowed.extend(child.ids)
                if child.children:
                    self._walk(after, child, allowed)

    def rule(self) -> ToolCallRule:
        """A fresh rule for one row's next action."""
        return ToolCallRule(self)


class ToolCallRule:
    """One row's ``ToolCallGrammar`` state over its completion (a ``TokenConstraint``)."""

    name = "tool_call"
    """How traces name this rule (``SamplingParams.constraint``)."""

    def __init__(self, grammar: ToolCallGrammar) -> None:
        self.grammar = grammar
        self._text = ""
        self._state: State | None = grammar.start

    def allowed(self, text: str) -> torch.Tensor | None:
        if text.startswith(self._text):
            self._state = self.grammar.advance(self._state, text[len(self._text):])
        else:
            self._state = self.grammar.advance(self.grammar.start, text)
        self._text = text
        # Off the language (only possible for text not drawn under this rule): say nothing.
        return None if self._state is None else self.grammar.mask(self._state)


class AllRules:
    """Several rules on one row: a token must be allowed by each rule that has a say.

    Where the rules together would allow nothing, the first rule's mask is kept alone (the
    grammar, listed first, keeps the call well-formed even then)."""

    def __init__(self, rules: Sequence[Any]) -> None:
        if not rules:
            raise ValueError("rules: give at least one rule")
        self.rules = tuple(rules)
        self.name = "+".join(str(getattr(rule, "name", type(rule).__name__)) for rule in rules)

    def allowed(self, text: str) -> torch.Tensor | None:
        masks = [mask for mask in (rule.allowed(text) for rule in self.rules) if mask is not None]
        if not masks:
            return None
        combined = masks[0]
        for mask in masks[1:]:
            both = combined & mask
            if bool(both.any()):
                combined = both
        return combined
