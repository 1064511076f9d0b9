"""Properties of the advantage estimators, checked on random inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracerl import batch_gae, batch_gae_reference, gae, group_advantages, rloo_advantages, whiten

unit = st.floats(0.0, 1.0)
coefficients = st.sampled_from([0.0, 1.0, 0.5, 0.9, 0.99]) | unit


def _random_batch(seed: int, rows: int, length: int, density: float, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, length, generator=generator) < density
    rewards = torch.randn(rows, length, generator=generator, dtype=dtype) * mask
    values = torch.randn(rows, length, generator=generator, dtype=dtype)
    boot = torch.randn(rows, generator=generator, dtype=dtype)
    return rewards, values, mask, boot


def _row_gae(rewards, values, mask, boot, gamma, trace_decay):
    """The 1-D form on one row's action positions; the last action bootstraps and stops."""
    idx = torch.nonzero(mask).flatten().tolist()
    if not idx:
        return []
    r = [float(rewards[i]) for i in idx]
    v = [float(values[i]) for i in idx]
    nv = [*v[1:], float(boot)]
    truncated = [False] * (len(idx) - 1) + [True]
    return gae(r, v, nv, [False] * len(idx), truncated, gamma=gamma, trace_decay=trace_decay)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 4),
    length=st.integers(1, 40),
    density=st.floats(0.0, 1.0),
    gamma=coefficients,
    trace_decay=coefficients,
)
def test_batch_gae_equals_the_one_dimensional_form(seed, rows, length, density, gamma, trace_decay):
    rewards, values, mask, boot = _random_batch(seed, rows, length, density, torch.float64)
    advantages, returns = batch_gae(rewards, values, mask, boot, gamma, trace_decay)
    for b in range(rows):
        expected = _row_gae(rewards[b], values[b], mask[b], boot[b], gamma, trace_decay)
        got = advantages[b][mask[b]].tolist()
        assert got == pytest.approx(expected, abs=1e-9)
    assert bool((advantages[~mask] == 0).all()) and bool((returns[~mask] == 0).all())
    assert torch.allclose(returns[mask], (advantages + values)[mask], atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("gamma", "trace_decay"),
    [(1.0, 1.0), (0.99, 0.95), (0.5, 0.9), (0.2, 0.3), (1e-3, 0.5), (0.9, 0.0), (0.0, 0.7)],
)
def test_fast_path_equals_the_loop_across_chunks(dtype, gamma, trace_decay):
    # Lengths well past one chunk at small decays, and not a multiple of the chunk length.
    rewards, values, mask, boot = _random_batch(7, 5, 1537, 0.6, dtype)
    fast = batch_gae(rewards, values, mask, boot, gamma, trace_decay)
    slow = batch_gae_reference(
        rewards.double(), values.double(), mask, boot.double(), gamma, trace_decay
    )
    tolerance = 1e-9 if dtype == torch.float64 else 5e-4
    for got, want in zip(fast, slow, strict=True):
        assert got.dtype == dtype
        assert torch.allclose(got.double(), want, atol=tolerance, rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    rewards=st.lists(st.floats(-5, 5), min_size=1, max_size=30), gamma=unit, seed=st.integers(0, 99)
)
def test_full_trace_decay_on_terminated_row_is_discounted_return_minus_value(rewards, gamma, seed):
    values = np.random.default_rng(seed).normal(size=len(rewards)).tolist()
    advantages, _ = batch_gae([rewards], [values], [[1] * len(rewards)], [0.0], gamma, 1.0)
    for t in range(len(rewards)):
        discounted = sum(gamma**k * r for k, r in enumerate(rewards[t:]))
        assert advantages[0][t] == pytest.approx(discounted - values[t], abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 999), length=st.integers(1, 30), gamma=unit)
def test_zero_trace_decay_is_the_one_step_residual(seed, length, gamma):
    rewards, values, mask, boot = _random_batch(seed, 2, length, 0.5, torch.float64)
    advantages, _ = batch_gae(rewards, values, mask, boot, gamma, 0.0)
    for b in range(2):
        idx = torch.nonzero(mask[b]).flatten().tolist()
        following = ([float(values[b, i]) for i in idx[1:]] + [float(boot[b])]) if idx else []
        for i, nxt in zip(idx, following, strict=True):
            residual = float(rewards[b, i]) + gamma * nxt - float(values[b, i])
            assert float(advantages[b, i]) == pytest.approx(residual, abs=1e-12)


def test_fragment_bootstrapped_from_its_continuation_is_the_truncated_whole():
    # A fragment cut at a compaction bootstraps from the value of the state the task continues
    # from; it then differs from the whole attempt only by the advantage carried past the cut,
    # decayed by (gamma * trace_decay) per action, and the later fragment is unchanged.
    gamma, trace_decay, cut = 0.97, 0.9, 25
    rewards, values, mask, _ = _random_batch(3, 1, 60, 0.7, torch.float64)
    zero = torch.zeros(1, dtype=torch.float64)
    whole, _ = batch_gae(rewards, values, mask, zero, gamma, trace_decay)
    continuation = cut + int(torch.nonzero(mask[0, cut:]).flatten()[0])
    first, _ = batch_gae(
        rewards[:, :cut],
        values[:, :cut],
        mask[:, :cut],
        values[0, continuation][None],
        gamma,
        trace_decay,
    )
    second, _ = batch_gae(
        rewards[:, cut:], values[:, cut:], mask[:, cut:], zero, gamma, trace_decay
    )
    assert torch.allclose(second, whole[:, cut:], atol=1e-12)
    for t in torch.nonzero(mask[0, :cut]).flatten().tolist():
        steps = int(mask[0, t:cut].sum())
        carried = (gamma * trace_decay) ** steps * whole[0, continuation]
        assert float(first[0, t]) == pytest.approx(float(whole[0, t] - carried), abs=1e-12)


def test_numpy_and_list_inputs_return_their_own_kind():
    rewards, values, mask, boot = _random_batch(1, 2, 9, 0.5, torch.float64)
    tensor_result, _ = batch_gae(rewards, values, mask, boot, 0.9, 0.8)
    array_result, _ = batch_gae(
        rewards.numpy(), values.numpy(), mask.numpy(), boot.numpy(), 0.9, 0.8
    )
    list_result, _ = batch_gae(
        rewards.tolist(), values.tolist(), mask.tolist(), boot.tolist(), 0.9, 0.8
    )
    assert isinstance(array_result, np.ndarray) and isinstance(list_result, list)
    assert np.allclose(array_result, tensor_result.numpy()) and np.allclose(
        list_result, tensor_result.numpy()
    )


@settings(max_examples=50, deadline=None)
@given(
    rewards=st.lists(st.floats(-10, 10), min_size=4, max_size=24),
    shift=st.floats(-100, 100),
    std=st.sampled_from(["population", "sample"]),
    scale=st.sampled_from(["std", None]),
)
def test_group_advantages_are_invariant_to_shifting_rewards(rewards, shift, std, scale):
    ids = [i % 2 for i in range(len(rewards))]
    base, _ = group_advantages(rewards, ids, scale=scale, std=std)
    shifted, _ = group_advantages([r + shift for r in rewards], ids, scale=scale, std=std)
    assert shifted == pytest.approx(base, abs=1e-4, rel=1e-4)


def test_sample_std_convention_and_mean_centering():
    pop, _ = group_advantages([0, 0, 1, 1], [0] * 4, eps=0.0)
    sample, report = group_advantages([0, 0, 1, 1], [0] * 4, std="sample", eps=0.0)
    centred, _ = group_advantages([0, 0, 1, 1], [0] * 4, scale=None)
    assert pop == pytest.approx([-1, -1, 1, 1])
    assert sample == pytest.approx([x * np.sqrt(3 / 4) for x in [-1, -1, 1, 1]])
    assert report.stds[0] == pytest.approx(np.std([0, 0, 1, 1], ddof=1))
    assert centred == pytest.approx([-0.5, -0.5, 0.5, 0.5])


def test_rloo_leaves_one_out():
    advantages = rloo_advantages([1.0, 0.0, 0.0, 2.0, 4.0], ["a", "a", "a", "b", "b"])
    assert advantages == pytest.approx([1.0, -0.5, -0.5, -2.0, 2.0])


def test_whiten_uses_masked_statistics_only():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = whiten(values, mask)
    kept = out[0, :3]
    assert float(out[0, 3]) == 0.0
    assert float(kept.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(kept.pow(2).mean()) == pytest.approx(1.0, abs=1e-6)


def test_out_buffers_are_written_and_results_never_share_the_workspace():
    rewards, values, mask, boot = _random_batch(3, 6, 700, 0.5, torch.float32)
    first_advantages, first_returns = batch_gae(rewards, values, mask, boot, 0.99, 0.95)
    kept = first_advantages.clone(), first_returns.clone()
    # A second call on other data reuses the cached workspace; the first results must not move.
    other = _random_batch(4, 6, 700, 0.5, torch.float32)
    batch_gae(*other, 0.99, 0.95)
    assert torch.equal(first_advantages, kept[0]) and torch.equal(first_returns, kept[1])
    assert first_advantages.untyped_storage().data_ptr() != first_returns.untyped_storage().data_ptr()
    out = (torch.full_like(rewards, 7.0), torch.full_like(rewards, 7.0))
    advantages, returns = batch_gae(rewards, values, mask, boot, 0.99, 0.95, out=out)
    assert advantages is out[0] and returns is out[1]
    assert torch.equal(advantages, kept[0]) and torch.equal(returns, kept[1])


def test_out_buffers_are_checked():
    rewards, values, mask, boot = _random_batch(5, 2, 9, 0.5, torch.float32)
    with pytest.raises(ValueError, match="out advantages"):
        batch_gae(rewards, values, mask, boot, out=(torch.empty(2, 8), torch.empty(2, 9)))
    with pytest.raises(ValueError, match="out returns"):
        batch_gae(rewards, values, mask, boot, out=(torch.empty(2, 9), torch.empty(2, 9).double()))
    shared = torch.empty(2, 9)
    with pytest.raises(ValueError, match="overlap"):
        batch_gae(rewards, values, mask, boot, out=(shared, shared))
    with pytest.raises(ValueError, match="overlaps an input"):
        batch_gae(rewards, values, mask, boot, out=(rewards, torch.empty(2, 9)))


@pytest.mark.parametrize("position", ["action", "other"])
@pytest.mark.parametrize("name", ["rewards", "values"])
def test_non_finite_inputs_are_named_on_the_blocked_path(position, name):
    rewards, values, mask, boot = _random_batch(6, 3, 300, 0.5, torch.float32)
    row, column = 1, int(torch.nonzero(mask[1] if position == "action" else ~mask[1])[0])
    bad = rewards if name == "rewards" else values
    bad[row, column] = float("nan")
    with pytest.raises(ValueError, match=name):
        batch_gae(rewards, values, mask, boot, 0.99, 0.95)
