"""``update.edit_text_weight``: which action tokens are an edit's text, and what the weight
does to the loss (the policy-gradient and entropy terms only; micro-batching unchanged)."""

from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tracerl.models.tiny import train_tokenizer
from tracerl.rollout.decoding.constraints import VocabularyTexts
from tracerl.train.config import CriticConfig, UpdateConfig
from tracerl.train.edit_text import edit_text_mask, string_value_spans
from tracerl.train.update import freeze_old, token_loss

sys.path.insert(0, str(Path(__file__).parent))
from test_train_exactness import make_model, params, step
from train_rows import make_batch

CALL = ('<tool_call>{"name": "replace", "arguments": {"line": 7, "old": "n):", '
        '"new": "n + 1):"}}</tool_call>')


def test_spans_cover_each_edit_value_through_its_closing_quote() -> None:
    assert [CALL[a:b] for a, b in string_value_spans(CALL)] == ['n):"', 'n + 1):"']
    escaped = '{"old": "say \\"hi\\"", "new": "x"}'
    assert [escaped[a:b] for a, b in string_value_spans(escaped)] == ['say \\"hi\\""', 'x"']
    whole = '{"name": "write_file", "arguments": {"path": "a.py", "content": "x = 1\\n"}}'
    assert [whole[a:b] for a, b in string_value_spans(whole)] == ['x = 1\\n"']
    # A string the turn's token cap cut off runs to the end; other keys are never edit text.
    cut = CALL[:CALL.index("n + 1") + 3]
    assert [cut[a:b] for a, b in string_value_spans(cut)] == ['n):"', "n +"]
    assert string_value_spans('{"name": "run_tests", "arguments": {}}') == []


def test_mask_marks_the_edit_tokens_of_each_action_and_nothing_else() -> None:
    corpus = [CALL, "PASS", "FAIL: expected 3", "def f(n):\n    return n + 1\n"] * 20
    tokenizer = train_tokenizer(corpus, vocab_size=300)
    texts = VocabularyTexts(tokenizer, len(tokenizer))
    call = tokenizer.encode(CALL, add_special_tokens=False)
    seen = tokenizer.encode("OK: line 7 is now: n + 1):", add_special_tokens=False)
    ids = torch.tensor([call + seen + call, seen + call + [0] * len(call)])
    action = torch.zeros(ids.shape, dtype=torch.bool)
    n, m = len(call), len(seen)
    action[0, :n] = True
    action[0, n + m:] = True
    action[1, m:m + n] = True
    edits = edit_text_mask(ids, action, texts)
    assert not bool((edits & ~action).any())  # observations (the same text) are never marked
    for row, start in ((0, 0), (0, n + m), (1, m)):
        marked = [int(t) for t, e in zip(ids[row, start:start + n], edits[row, start:start + n],
                                         strict=True) if e]
        text = tokenizer.decode(marked)
        assert "n):" in text and "n + 1):" in text
        assert "replace" not in text and "line" not in text and "7" not in text
    assert int(edits[0].sum()) == 2 * int(edits[1].sum())


def test_weights_scale_the_policy_and_entropy_terms_and_leave_the_kl() -> None:
    config = UpdateConfig(entropy_coef=0.2, kl_coef=0.3)
    model, critic = make_model(), CriticConfig()
    batch = freeze_old(model, make_batch(), micro_batch_rows=4, reference=copy.deepcopy(model))
    with torch.no_grad():  # move the policy off the anchors so every term is nonzero
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    mask = batch.action_mask
    zero = (torch.rand(mask.shape, generator=torch.Generator().manual_seed(4)) < 0.5) & mask
    weights = (~zero).double() * mask
    weighted, _ = token_loss(model, replace(batch, token_weights=weights), config, critic)
    plain, _ = token_loss(model, batch, config, critic)
    kl_only, _ = token_loss(model, replace(batch, advantages=torch.zeros_like(batch.advantages)),
                            replace(config, entropy_coef=0.0), critic)
    assert 0 < int(zero.sum()) < int(mask.sum())
    kept = mask & ~zero
    assert torch.allclose(weighted[kept], plain[kept], atol=1e-12)
    assert torch.allclose(weighted[zero], kl_only[zero], atol=1e-12)
    assert not torch.allclose(plain[zero], kl_only[zero], atol=1e-6)
    ones, _ = token_loss(model, replace(batch, token_weights=mask.double()), config, critic)
    assert torch.equal(ones, plain)


@pytest.mark.parametrize("loss_level", ["token", "sequence"])
def test_weighted_micro_batches_equal_the_full_batch(loss_level: str) -> None:
    config = UpdateConfig(micro_batch_rows=100, loss_mode="sequence_mean", entropy_coef=-0.05,
                          loss_level=loss_level)  # type: ignore[arg-type]
    batch = make_batch()
    generator = torch.Generator().manual_seed(5)
    weights = torch.where(torch.rand(batch.action_mask.shape, generator=generator) < 0.4,
                          0.25, 1.0).double() * batch.action_mask
    batch = replace(batch, token_weights=weights)
    full = make_model()
    start = copy.deepcopy(full)
    step(full, batch, config, CriticConfig())
    for micro in (1, 4):
        model = copy.deepcopy(start)
        step(model, batch, replace(config, micro_batch_rows=micro), CriticConfig())
        assert torch.allclose(params(model), params(full), atol=1e-6, rtol=0)
    unweighted = copy.deepcopy(start)
    step(unweighted, replace(batch, token_weights=None), config, CriticConfig())
    assert not torch.allclose(params(unweighted), params(full), atol=1e-6, rtol=0)


def test_the_trainer_weighs_the_edit_text_of_its_rows(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tiny_runs import tiny_recipe

    from tracerl.rollout.decoding.constraints import VocabularyTexts
    from tracerl.train.config import load_config
    from tracerl.train.trainer import Trainer

    seen: list[torch.Tensor] = []
    update = Trainer.update

    def recording_update(self: Trainer, rows: Any, *args: Any, **kwargs: Any) -> Any:
        assert rows.token_weights is not None
        vocabulary = self._token_texts()
        assert isinstance(vocabulary, VocabularyTexts)
        edits = edit_text_mask(rows.input_ids, rows.action_mask, vocabulary)
        expected = torch.where(edits, 0.5, 1.0) * rows.action_mask.float()
        assert torch.equal(rows.token_weights, expected)
        seen.append(rows.token_weights)
        return update(self, rows, *args, **kwargs)

    monkeypatch.setattr(Trainer, "update", recording_update)
    recipe = tiny_recipe(tmp_path, sft={"enabled": False}, steps=1,
                         update={"edit_text_weight": 0.5},
                         eval={"samples_per_task": 1, "greedy": False})
    Trainer(load_config(recipe)).run()
    assert len(seen) == 1 and bool((seen[0] > 0).any())
