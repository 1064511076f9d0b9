from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracerl.models.tiny import (
    EOS_TOKEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TinyModelConfig,
    build_tiny_model,
    count_parameters,
    load_tiny,
    render_tool_call,
    save_tiny,
    train_tokenizer,
)

CODE = (
    "def add(a, b):\n"
    "    return a + b\n"
    "\n"
    "\n"
    "class Stack:\n"
    "\tdef pop(self):\n"
    "        if not self.items:\n"
    '            raise IndexError("empty")\n'
    "        return self.items.pop()  # done\n"
)
CORPUS = [CODE] * 20 + [render_tool_call("run_tests", {})] * 10 + ["fix the bug in add"] * 5

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return train_tokenizer(CORPUS, vocab_size=512)


def test_code_round_trips_exactly_with_whitespace(tokenizer) -> None:  # type: ignore[no-untyped-def]
    for text in (CODE, CODE.replace("    ", "  "), "x  =\t1\r\n\n   \n", "unseen_name(ü, 3.5e-2)"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=60))
def test_any_text_round_trips(text: str) -> None:
    tok = _shared_tokenizer()
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


_CACHE: dict[str, object] = {}


def _shared_tokenizer():  # type: ignore[no-untyped-def]
    if "tok" not in _CACHE:
        _CACHE["tok"] = train_tokenizer(CORPUS, vocab_size=512)
    return _CACHE["tok"]


def test_frequent_words_and_indentation_are_single_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(CODE, add_special_tokens=False))
    decoded = [tokenizer.convert_tokens_to_string([p]) for p in pieces]
    for word in ("return", "self", "\n    ", "\n        ", "IndexError"):
        assert word in decoded, word
    # Tool-call markers are one token each and survive skip_special_tokens.
    call = render_tool_call("edit", {"path": "a.py"})
    ids = tokenizer.encode(call, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids(TOOL_CALL_OPEN)
    assert ids[-1] == tokenizer.convert_tokens_to_ids(TOOL_CALL_CLOSE)
    assert tokenizer.decode(ids, skip_special_tokens=True) == call


def test_operators_in_a_tool_call_are_the_code_s_tokens() -> None:
    # Frequent `"old": ">=",`-like runs would merge into one token under a pattern that lets
    # quotes and operators share a chunk; then the policy could not copy an operator.
    ops = (">=", "<=", "-", "+", "[-1]", "!=")
    pairs = [(a, b) for a in ops for b in ops if a != b]
    calls = [render_tool_call("replace", {"line": 6, "old": a, "new": b}) for a, b in pairs]
    code = ["    if x >= y and a - b != 0:", "    return xs[-1] + ys[0] <= 3"]
    tokenizer = train_tokenizer(calls * 20 + code * 20, vocab_size=400)
    for call, (op, _) in zip(calls, pairs, strict=True):
        ids = tokenizer.encode(call, add_special_tokens=False)
        run = tokenizer.encode(op, add_special_tokens=False)
        assert any(ids[i:i + len(run)] == run for i in range(len(ids))), (op, call)
    for piece in (">=", "-", "!=", "<=", "+", "[", "]"):
        run = tokenizer.encode(piece, add_special_tokens=False)
        assert len(run) == 1, piece  # merged in the code, and the same token in the calls


def test_training_is_deterministic() -> None:
    a = train_tokenizer(CORPUS, vocab_size=512)
    b = train_tokenizer(CORPUS, vocab_size=512)
    assert a.get_vocab() == b.get_vocab()
    assert a.encode(CODE) == b.encode(CODE)


def test_special_tokens_and_padding_side(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert tokenizer.eos_token == EOS_TOKEN
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    assert tokenizer.padding_side == "left"
    # Plain encoding adds nothing; the chat template adds BOS.
    assert tokenizer.encode("x") == tokenizer.encode("x", add_special_tokens=False)


def test_bad_tokenizer_arguments() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CORPUS, vocab_size=10)
    with pytest.raises(ValueError, match="min_frequency"):
        train_tokenizer(CORPUS, min_frequency=0)


def test_chat_template_renders_roles_tools_and_hermes_tool_calls(tokenizer) -> None:  # type: ignore[no-untyped-def]
    tools = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object"}}}]
    as_string = {"type": "function", "function": {"name": "edit", "arguments": '{"path": "a.py"}'}}
    as_dict = {"type": "function", "function": {"name": "edit", "arguments": {"path": "a.py"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "fix add"},
        {"role": "assistant", "content": "ok", "tool_calls": [as_string]},
        {"role": "tool", "content": "1 passed"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|bos|><|system|>Be brief.\nTools:\n")
    assert json.dumps(tools[0]["function"]) in text
    assert "<|user|>fix add<|end|>" in text
    assert '<|assistant|>ok<tool_call>{"name": "edit", "arguments": {"path": "a.py"}}</tool_call><|end|>' in text
    assert text.endswith("<|tool|>1 passed<|end|><|assistant|>")
    assert text.count("Be brief.") == 1
    # Arguments as a mapping render the same text as the serialised JSON string.
    messages[2] = {**messages[2], "tool_calls": [as_dict]}
    assert tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False) == text
    assert render_tool_call("edit", {"path": "a.py"}) in text
    # Without tools, the system message is an ordinary message.
    plain = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert plain == "<|bos|><|system|>Be brief.<|end|><|user|>fix add<|end|>"


def test_chat_template_refuses_unknown_role(tokenizer) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(Exception, match="unknown chat role: critic"):
        tokenizer.apply_chat_template([{"role": "critic", "content": "x"}], tokenize=False)


def test_model_shape_and_determinism(tokenizer) -> None:  # type: ignore[no-untyped-def]
    model = build_tiny_model(tokenizer, seed=3)
    assert model.config.vocab_size == len(tokenizer)
    assert 0.7e6 < count_parameters(model, exclude_embeddings=True) < 1.2e6
    assert count_parameters(model) == count_parameters(model, exclude_embeddings=True) + (
        len(tokenizer) * 128
    )
    same = build_tiny_model(tokenizer, seed=3)
    other = build_tiny_model(tokenizer, seed=4)
    pairs = list(zip(model.parameters(), same.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))
    state = torch.get_rng_state()
    build_tiny_model(tokenizer, seed=5)
    assert torch.equal(state, torch.get_rng_state())


def test_bad_model_config() -> None:
    with pytest.raises(ValueError, match="divisible by num_heads"):
        TinyModelConfig(hidden_size=130, num_heads=4)
    with pytest.raises(ValueError, match="num_layers"):
        TinyModelConfig(num_layers=0)


def test_save_and_load_round_trip(tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    model = build_tiny_model(tokenizer, config, seed=1).eval()
    save_tiny(model, tokenizer, tmp_path / "tiny")
    loaded, loaded_tok = load_tiny(tmp_path / "tiny")
    auto_model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", local_files_only=True)
    auto_tok = AutoTokenizer.from_pretrained(tmp_path / "tiny", local_files_only=True)
    ids = torch.tensor([tokenizer.encode(CODE)])
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(loaded.eval()(ids).logits, expected)
        assert torch.equal(auto_model.eval()(ids).logits, expected)
    messages = [{"role": "user", "content": "fix add"}]
    for tok in (loaded_tok, auto_tok):
        assert tok.encode(CODE) == tokenizer.encode(CODE)
        assert tok.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
            messages, tokenize=False
        )
        assert tok.padding_side == "left"
    with pytest.raises(ValueError, match=r"config\.json"):
        load_tiny(tmp_path / "missing")


def test_word_list_makes_single_tokens_and_names_split_at_underscores() -> None:
    from tracerl.models.words import WORDS

    assert list(WORDS) == sorted(set(WORDS)) and len(WORDS) > 500
    tokenizer = train_tokenizer(CORPUS, vocab_size=4096, words=WORDS)
    for word in ("tower", "spread", "middle"):
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1, word
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("keep_big", add_special_tokens=False))
    assert pieces == ["keep", "_", "big"]
