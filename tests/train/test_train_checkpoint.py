"""A checkpoint with NaN or infinite weights is refused when it is loaded (for evaluation,
serving or a resumed run), naming the tensor, instead of being evaluated as a 0 % policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracerl.cli import main
from tracerl.envs.suite import generate_split
from tracerl.envs.tasks import dump_tasks
from tracerl.eval.evaluate import load_policy
from tracerl.models.tiny import TinyModelConfig, build_tiny_model, save_tiny, train_tokenizer
from tracerl.models.weights import check_finite_weights
from tracerl.rollout.policies.hf import HFPolicy

TENSOR = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved policy whose TENSOR holds 3 NaN values."""
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n"] * 5, vocab_size=300)
    model = build_tiny_model(tokenizer, TinyModelConfig(
        hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=512))
    with torch.no_grad():
        model.get_parameter(TENSOR).view(-1)[[0, 5, 7]] = float("nan")
    return save_tiny(model, tokenizer, tmp_path_factory.mktemp("ckpt") / "step-000003")


def test_tracerl_eval_refuses_nan_weights_naming_the_tensor(
        poisoned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = tmp_path / "tasks.jsonl"
    dump_tasks(generate_split("heldout", seed=0, count=1), tasks)
    code = main(["eval", "--policy", str(poisoned), "--tasks", str(tasks), "--samples", "1",
                 "--json", str(tmp_path / "out.json")])
    error = capsys.readouterr().err
    assert code == 2
    assert f"checkpoint {poisoned}: tensor '{TENSOR}' has 3 NaN values" in error, error
    assert not (tmp_path / "out.json").exists()


def test_every_loader_checks_the_weights(poisoned: Path) -> None:
    message = rf"tensor '{TENSOR}' has 3 NaN values"
    with pytest.raises(ValueError, match=message):
        load_policy(poisoned)
    with pytest.raises(ValueError, match=message):
        HFPolicy.from_pretrained(str(poisoned))
    # The trainer's loader: a resumed run (newest checkpoint), the warm start, model.path.
    from tracerl.train.setup import load_model

    with pytest.raises(ValueError, match=message):
        load_model(poisoned)


def test_infinite_values_are_counted_and_finite_weights_pass() -> None:
    model = torch.nn.Linear(4, 3)
    check_finite_weights(model, "ok")  # finite: nothing raised
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
        model.weight[1, 1] = float("-inf")
        model.bias[2] = float("nan")
    with pytest.raises(ValueError, match=r"checkpoint here: tensor 'weight' has 2 infinite "
                                         r"values; tensor 'bias' has 1 NaN values"):
        check_finite_weights(model, "here")
