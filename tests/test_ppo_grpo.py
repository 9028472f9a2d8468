import copy

import pytest
import torch

from grpo import GRPOConfig, group_advantages, grpo_loss, grpo_update
from logprobs import add_logprobs
from plumbing.distributed import pad_rows
from plumbing.models import make_tiny_policy
from ppo import PPOConfig, ValueModel, compute_gae, masked_whiten, policy_loss, ppo_update, token_rewards, value_loss
from rollout import collate
from update import kl_penalty, masked_mean


def ragged(N=5, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(N, T, generator=g) > 0.4).long()
    mask[:, 0] = 0
    mask[-1] = 0  # one row without any policy token
    return mask, torch.randn(N, T, generator=g), torch.randn(N, T, generator=g), g


def slow_gae(rewards, values, mask, gamma, lam):
    N, T = mask.shape
    adv = torch.zeros(N, T)
    for n in range(N):
        steps = [t for t in range(T) if mask[n, t]]
        gae = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            nv = values[n, steps[k + 1]].item() if k + 1 < len(steps) else 0.0
            delta = rewards[n, t].item() + gamma * nv - values[n, t].item()
            gae = delta + gamma * lam * gae
            adv[n, t] = gae
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_slow_reference_on_ragged_masks(gamma, lam):
    for seed in range(3):
        mask, rewards, values, _ = ragged(seed=seed)
        adv, ret = compute_gae(rewards * mask, values * mask, mask, gamma, lam)
        ref = slow_gae(rewards * mask, values * mask, mask, gamma, lam)
        assert torch.allclose(adv, ref, atol=1e-5)
        assert torch.allclose(ret, (ref + values) * mask, atol=1e-5)
        assert (adv[mask == 0] == 0).all()


def test_terminal_reward_on_last_policy_token_and_gae_returns_it():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0, 0], [0] * 8])
    r = token_rewards(torch.tensor([0.7, 0.2, 0.9]), mask)
    assert r[0].tolist() == [0, 0, 0, 0, 0, 0, pytest.approx(0.7), 0] and r[1, 4] == pytest.approx(0.2) and \
        r[2].sum() == 0
    adv, ret = compute_gae(r, torch.zeros(3, 8), mask, 1.0, 1.0)
    assert torch.allclose(adv[0][mask[0] == 1], torch.full((4,), 0.7))  # gamma=lam=1, V=0: the return
    kl = torch.ones(3, 8)
    assert token_rewards(torch.tensor([0.7, 0.2, 0.9]), mask, kl, 0.1)[0, 1] == pytest.approx(-0.1)


def test_masked_whiten():
    mask, x, _, _ = ragged()
    w = masked_whiten(x, mask)
    assert abs(masked_mean(w, mask).item()) < 1e-5
    assert abs(masked_mean(w ** 2, mask).item() - 1) < 1e-3 and (w[mask == 0] == 0).all()
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0  # empty mask: 0, not NaN


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.9, 0.3, 0.6])
    gid = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3])
    a = group_advantages(r, gid, eps=0.0)
    s = 2 ** -0.5  # std of [1, 0] (unbiased) = 0.7071
    assert torch.allclose(a[:2], torch.tensor([0.5 / s, -0.5 / s]))
    assert a[2:5].tolist() == [0, 0, 0]  # equal rewards -> 0 (eps avoids 0/0); group of one -> 0
    g3 = torch.tensor([0.9, 0.3, 0.6])
    assert torch.allclose(a[5:], (g3 - g3.mean()) / g3.std())
    assert torch.allclose(group_advantages(r, gid, scale="none")[5:], g3 - g3.mean())
    # per-turn rows: dialogue 0 has three rows, dialogue 1 one row; stats are per dialogue
    a = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 0, 0]), eps=0.0,
                         dialogue_ids=torch.tensor([0, 0, 0, 1]))
    assert torch.allclose(a, torch.tensor([s, s, s, -s]))


def test_clipping_boundaries_zero_gradient_outside_trust_region():
    old = torch.zeros(1, 6)
    ratios = torch.tensor([[0.5, 0.79, 1.0, 1.19, 1.21, 2.0]])
    for A, dead in [(1.0, [False, False, False, False, True, True]), (-1.0, [True, True, False, False, False, False])]:
        lp = ratios.log().clone().requires_grad_(True)
        loss, st = policy_loss(lp, old, torch.full((1, 6), A), torch.ones(1, 6), clip_eps=0.2)
        loss.backward()
        assert [(g == 0).item() for g in lp.grad[0]] == dead
        assert st["clipfrac"] == pytest.approx(sum(dead) / 6)


def test_value_loss_clip():
    old = torch.zeros(1, 3)
    ret = torch.tensor([[2.0, 2.0, -2.0]])
    v = torch.tensor([[1.0, 0.3, -1.0]], requires_grad=True)
    loss, _ = value_loss(v, old, ret, torch.ones(1, 3), clip=0.5)
    loss.backward()
    # the clipped value (0.5) is further from the return than v=1.0 -> the clipped term wins, no gradient
    assert v.grad[0, 0] == 0 and v.grad[0, 1] != 0 and v.grad[0, 2] == 0


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert torch.allclose(kl_penalty(lp, ref, "k1"), torch.tensor([0.5, -1.0]))
    assert torch.allclose(kl_penalty(lp, ref, "k2"), torch.tensor([0.125, 0.5]))
    assert (kl_penalty(lp, ref, "k3") >= 0).all() and kl_penalty(lp, lp, "k3").abs().sum() == 0
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k4")


def test_loss_has_zero_gradient_where_mask_is_zero():
    mask, _, _, g = ragged()
    N, T = mask.shape
    old = -torch.rand(N, T, generator=g)
    lp = (old + 0.3 * torch.randn(N, T, generator=g)).requires_grad_(True)
    ref = old.clone()
    for agg in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]:
        lp.grad = None
        loss, _ = grpo_loss(lp, old, ref, torch.randn(N, generator=g), mask, 0.2, 0.1, agg)
        loss.backward()
        assert (lp.grad[mask == 0] == 0).all() and (lp.grad[mask == 1] != 0).any()
    lp.grad = None
    policy_loss(lp, old, torch.randn(N, T, generator=g), mask)[0].backward()
    assert (lp.grad[mask == 0] == 0).all()
    v = torch.randn(N, T, requires_grad=True)
    value_loss(v, torch.zeros(N, T), torch.randn(N, T), mask)[0].backward()
    assert (v.grad[mask == 0] == 0).all()


def test_empty_masks_give_no_nan():
    z = torch.zeros(2, 4)
    lp = torch.zeros(2, 4, requires_grad=True)
    for agg in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]:
        loss, st = grpo_loss(lp, z, z, torch.ones(2), z, agg=agg)
        loss.backward()
        assert loss.item() == 0 and not torch.isnan(lp.grad).any()


def test_loss_aggregations_by_hand():
    # ratio 1 everywhere: per-token loss = -A
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    adv = torch.tensor([1.0, 2.0])
    z = torch.zeros(2, 4)
    tm = grpo_loss(z, z, None, adv, mask, agg="token-mean")[0].item()
    sm = grpo_loss(z, z, None, adv, mask, agg="seq-mean-token-mean")[0].item()
    ss = grpo_loss(z, z, None, adv, mask, agg="seq-mean-token-sum")[0].item()
    assert tm == pytest.approx(-(3 * 1 + 2) / 4) and sm == pytest.approx(-(1 + 2) / 2) and \
        ss == pytest.approx(-(3 + 2) / 2)


class Capture:
    """An optimizer that records the gradient it would apply, then leaves the weights alone."""
    def __init__(self, params):
        self.params, self.grads = list(params), []

    def step(self):
        self.grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.params])

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def synthetic_batch(model, tok, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        L, R = 5 + i, 3 + (i * 2) % 7
        ids = torch.randint(0, 256, (L + R,), generator=g).tolist()
        rows.append((ids, [0] * L + [1] * R, float(torch.rand(1, generator=g)), i // 2, i))
    b = add_logprobs(collate(rows, tok.pad_token_id), model)
    # pretend the policy moved a bit since sampling, so ratios differ from 1 (some clipped)
    return b.__class__(**{**b.__dict__,
                          "old_logprobs": b.old_logprobs + 0.3 * torch.randn(b.old_logprobs.shape, generator=g)
                                          * b.loss_mask,
                          "ref_logprobs": b.old_logprobs.clone()})


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_grpo_gradient_accumulation_equals_full_batch(agg):
    model, tok = make_tiny_policy(seed=1)
    batch = synthetic_batch(model, tok)
    grads = []
    for micro in (6, 1, 4):
        opt = Capture(model.parameters())
        cfg = GRPOConfig(minibatch_size=6, micro_batch_size=micro, loss_agg=agg, kl_coef=0.05, max_grad_norm=1e9)
        grpo_update(model, opt, batch, cfg, generator=torch.Generator().manual_seed(0))
        grads.append(opt.grads[0])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_ppo_gradient_accumulation_equals_full_batch():
    model, tok = make_tiny_policy(seed=2)
    critic = ValueModel.from_config(model.config)
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)
    batch = synthetic_batch(model, tok, seed=3)
    grads = []
    for micro in (6, 1, 4):
        aopt, copt = Capture(model.parameters()), Capture(critic.parameters())
        ppo_update(model, critic, (aopt, copt), batch,
                   PPOConfig(minibatch_size=6, micro_batch_size=micro, max_grad_norm=1e9),
                   generator=torch.Generator().manual_seed(0))
        grads.append(aopt.grads[0] + copt.grads[0])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_updates_count_minibatches_and_report_stats():
    model, tok = make_tiny_policy(seed=3)
    batch = synthetic_batch(model, tok, n=8)
    opt = Capture(model.parameters())
    st = grpo_update(model, opt, batch, GRPOConfig(minibatch_size=4, micro_batch_size=2, epochs=2))
    assert len(opt.grads) == 4  # 2 epochs x 2 minibatches
    for k in ("policy_loss", "clipfrac", "approx_kl", "grad_norm"):
        assert k in st and st[k] == st[k]
    critic = ValueModel.from_config(model.config)
    st = ppo_update(model, critic, (Capture(model.parameters()), Capture(critic.parameters())), batch,
                    PPOConfig(minibatch_size=8))
    for k in ("policy_loss", "value_loss", "entropy", "clipfrac", "vf_clipfrac", "grad_norm"):
        assert k in st and st[k] == st[k]
    assert grpo_update(model, opt, batch.select([]), GRPOConfig()) == {}


def test_value_model_save_and_load(tmp_path):
    model, _ = make_tiny_policy(seed=4)
    critic = ValueModel.from_config(model.config)
    torch.nn.init.normal_(critic.value_head.weight)
    critic.save_pretrained(str(tmp_path))
    back = ValueModel.from_pretrained(str(tmp_path))
    ids = torch.randint(0, 256, (2, 7))
    am = torch.ones_like(ids)
    assert torch.allclose(critic(ids, am), back(ids, am), atol=1e-5)
    assert (critic(ids, am)[:, 0] == 0).all()  # values[0] is the (unused) state before any token


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_on_policy_update_without_stored_old_logprobs_is_identical(algo):
    model, tok = make_tiny_policy(seed=5)
    b = synthetic_batch(model, tok, n=6, seed=5)
    exact = b.__class__(**{**b.__dict__, "old_logprobs": add_logprobs(b, model).old_logprobs, "ref_logprobs": None})
    missing = b.__class__(**{**b.__dict__, "old_logprobs": None, "ref_logprobs": None})
    grads, outs = [], []
    for batch in (exact, missing):
        opt = Capture(model.parameters())
        if algo == "grpo":
            out = grpo_update(model, opt, batch, GRPOConfig(minibatch_size=6, micro_batch_size=3),
                              generator=torch.Generator().manual_seed(0))
        else:
            critic = ValueModel.from_config(model.config)
            torch.manual_seed(0)
            out = ppo_update(model, critic, (opt, Capture(critic.parameters())), batch,
                             PPOConfig(minibatch_size=6, micro_batch_size=3),
                             generator=torch.Generator().manual_seed(0))
        grads.append(opt.grads[0])
        outs.append(out)
    for a, c in zip(*grads):
        assert torch.allclose(a, c, atol=1e-6, rtol=1e-4)
    # Issue 39: the update returns the log-probs it took as pi_old, equal to a separate pass's
    # (add_logprobs, before the update): the sampler mismatch needs no pass of its own. It
    # changes no batch, and with stored old log-probs it returns none.
    mask = b.loss_mask.bool()
    pi_old = outs[1]["pi_old"]
    assert missing.old_logprobs is None and "pi_old" not in outs[0] and pi_old.shape == exact.old_logprobs.shape
    assert torch.allclose(pi_old[mask], exact.old_logprobs[mask], atol=1e-5)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_padding_rows_contribute_zero_gradient(algo):
    """plumbing.distributed.pad_rows equalises row counts across FSDP processes without changing the update."""
    model, tok = make_tiny_policy(seed=6)
    b = synthetic_batch(model, tok, n=5, seed=6)
    padded = pad_rows(b, 8, tok.pad_token_id)
    assert len(padded) == 8 and padded.loss_mask[5:].sum() == 0 and len(set(padded.group_ids[5:].tolist())) == 3
    grads = []
    for batch in (b, padded):
        opt = Capture(model.parameters())
        if algo == "grpo":
            grpo_update(model, opt, batch, GRPOConfig(minibatch_size=8, micro_batch_size=3, kl_coef=0.1))
        else:
            torch.manual_seed(0)  # the same critic for both batches
            critic = ValueModel.from_config(model.config)
            torch.nn.init.normal_(critic.value_head.weight, std=0.1)
            ppo_update(model, critic, (opt, Capture(critic.parameters())), batch,
                       PPOConfig(minibatch_size=8, micro_batch_size=3))
        grads.append(opt.grads[0])
    for a, c in zip(*grads):
        assert torch.allclose(a, c, atol=1e-6, rtol=1e-4)
    empty = pad_rows(b.select([]), 2, tok.pad_token_id)
    assert len(empty) == 2 and empty.loss_mask.sum() == 0 and empty.attention_mask.sum() == 4


@pytest.mark.parametrize("eps", [1e-6, 0.0])
@pytest.mark.parametrize("scale", ["std", "none"])
def test_all_equal_groups_get_exactly_zero_advantage(eps, scale):
    """float32 rounding must not turn an all-equal group into a signal (0.85 x 3 gave -0.0555
    each; 0.11 x 3 with eps = 0 gave 0.8165)."""
    for n in range(2, 9):
        for k in range(101):
            r = torch.full((n + 2,), k / 100)
            r[-2:] = torch.tensor([0.0, 1.0])  # another group, with signal, in the same batch
            gid = torch.tensor([0] * n + [1, 1])
            a = group_advantages(r, gid, scale=scale, eps=eps)
            assert (a[:n] == 0).all(), (n, k, a[:n])
            assert (a[n:] != 0).all()
    # the per-turn path (several rows per dialogue) too
    a = group_advantages(torch.full((5,), 0.85), torch.zeros(5, dtype=torch.long), scale=scale, eps=eps,
                         dialogue_ids=torch.tensor([0, 0, 1, 2, 2]))
    assert (a == 0).all()


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.parametrize("epochs,minibatch", [(2, 8), (1, 4)])
def test_on_policy_shortcut_is_refused_beyond_one_optimizer_step(algo, epochs, minibatch):
    """old_logprobs=None means ratio 1: right for the first optimizer step only. With several
    epochs or minibatches the later steps would train with ratio 1 after the policy moved."""
    model, tok = make_tiny_policy(seed=7)
    b = synthetic_batch(model, tok, n=8, seed=7)
    b = b.__class__(**{**b.__dict__, "old_logprobs": None, "ref_logprobs": None})
    opt = Capture(model.parameters())
    with pytest.raises(ValueError, match="old_logprobs=None is only valid for one optimizer step"):
        if algo == "grpo":
            grpo_update(model, opt, b, GRPOConfig(epochs=epochs, minibatch_size=minibatch, micro_batch_size=4))
        else:
            critic = ValueModel.from_config(model.config)
            ppo_update(model, critic, (opt, Capture(critic.parameters())), b,
                       PPOConfig(epochs=epochs, minibatch_size=minibatch, micro_batch_size=4))
    assert opt.grads == []  # refused before any step


def test_grpo_entropy_bonus_is_applied_like_ppo():
    """GRPOConfig.entropy_coef adds -coef * entropy (aggregated like the policy loss) to the
    loss, as verl does whatever the advantage estimator. With all-equal rewards the surrogate has
    zero gradient, so the whole gradient is the entropy term's."""
    from grpo import aggregate
    from logprobs import token_logprobs
    model, tok = make_tiny_policy(seed=8)
    b = synthetic_batch(model, tok, n=6, seed=8)
    b = b.__class__(**{**b.__dict__, "rewards": torch.full((6,), 0.5), "ref_logprobs": None})
    for agg in ["token-mean", "seq-mean-token-sum"]:
        opt = Capture(model.parameters())
        grpo_update(model, opt, b, GRPOConfig(minibatch_size=6, micro_batch_size=4, loss_agg=agg, entropy_coef=0.3,
                                              max_grad_norm=1e9))
        model.zero_grad()
        _, ent = token_logprobs(model, b.input_ids, b.attention_mask, return_entropy=True, entropy_grad=True)
        (-0.3 * aggregate(ent, b.loss_mask, agg)).backward()
        ref = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        assert sum(g.abs().sum() for g in ref) > 0
        for a, r in zip(opt.grads[0], ref):
            assert torch.allclose(a, r, atol=1e-7, rtol=1e-4)
    opt = Capture(model.parameters())
    grpo_update(model, opt, b, GRPOConfig(minibatch_size=6, entropy_coef=0.0))
    assert all((g == 0).all() for g in opt.grads[0])  # no bonus, no signal: no gradient


def test_per_turn_rows_make_about_one_optimizer_step_per_turn():
    """Issue 29: the official think mode counts its minibatch (32 prompts x n) in turn-rows, so a
    rollout makes about as many optimizer steps as a dialogue has turns; ours made one."""
    from update import UpdateConfig, minibatch_count, needs_old_logprobs
    # 4 scenarios x 1 dialogue x 3 turns = 12 turn-rows; minibatch 4 scenarios: 3 optimizer steps
    rows = [([1, 2, 3], [0, 1, 1], 0.5, d, d * 3 + t) for d in range(4) for t in range(3)]
    b = collate(rows, 0)
    cfg = UpdateConfig(minibatch_size=4, group_size=1)
    assert minibatch_count(b, cfg) == 3 and needs_old_logprobs(b, cfg)
    one = collate(rows[::3], 0)  # one row per dialogue: one step, no stored old log-probs needed
    assert minibatch_count(one, cfg) == 1 and not needs_old_logprobs(one, cfg)
    # 10 turn-rows, minibatch 4: 3 optimizer steps, however many rows each holds (4, 3, 3)
    assert minibatch_count(collate(rows[:10], 0), cfg) == 3


def test_truncated_importance_sampling_against_an_independent_computation():
    """Issue 25: --rollout-is-cap C weights each token's clipped surrogate by min(pi_old / pi_sampler, C)
    (verl's and TRL's TIS). The weighted loss and its gradient, computed by hand in float64."""
    from update import truncated_is_weights
    g = torch.Generator().manual_seed(0)
    N, T, C = 3, 7, 2.0
    mask = (torch.rand(N, T, generator=g) > 0.3).float()
    old = -torch.rand(N, T, generator=g) * 3
    sampler = old + (torch.rand(N, T, generator=g) - 0.5) * 2  # pi_sampler differs from pi_old
    lp = (old + (torch.rand(N, T, generator=g) - 0.5) * 0.6).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 2.0])
    w = truncated_is_weights(old, sampler, C)
    loss, _ = grpo_loss(lp, old, None, adv, mask, clip_eps=0.2, is_weights=w)
    loss.backward()
    # By hand: r = exp(lp - old); per token max(-A r, -A clip(r)) * min(exp(old - sampler), C);
    # the mean over the masked tokens. d/dlp of -A r w is -A r w where the unclipped term is the
    # max (or both equal), 0 where the clipped term wins strictly.
    lp64, old64, s64, m64 = (x.detach().double() for x in (lp, old, sampler, mask))
    a64 = adv.double()[:, None]
    r = torch.exp(lp64 - old64)
    wt = torch.minimum(torch.exp(old64 - s64), torch.tensor(C, dtype=torch.float64))
    unclipped, clipped = -a64 * r, -a64 * r.clamp(0.8, 1.2)
    want = (torch.maximum(unclipped, clipped) * wt * m64).sum() / m64.sum()
    grad = torch.where(unclipped >= clipped, -a64 * r * wt, torch.zeros_like(r)) * m64 / m64.sum()
    assert abs(loss.item() - want.item()) < 1e-6
    assert torch.allclose(lp.grad.double(), grad, atol=1e-6)
    assert w.max() <= C and not w.requires_grad


def test_the_update_weights_tokens_only_with_a_cap_and_engine_logprobs():
    """update_loop applies TIS when --rollout-is-cap > 0 and the batch carries the engine's
    log-probs; without either the gradient is the plain one."""
    model, tok = make_tiny_policy(seed=0)
    rows = [([1, 2, 3 + i, 4 + 2 * i, 5, 6 + i], [0, 0, 1, 1, 1, 1], r, i // 2, i, [0, 0, -1.0, -2.0, -0.5, -3.0])
            for i, r in enumerate([0.1, 0.9, 0.4, 0.6])]
    grads = {}
    for name, cap, keep in [("plain", 0.0, True), ("no-engine", 2.0, False), ("tis", 2.0, True)]:
        b = collate(rows, 0, sampled_by_engine=True)
        if not keep:
            b.sampler_logprobs = None
        m = copy.deepcopy(model)
        opt = Capture(m.parameters())
        grpo_update(m, opt, b, GRPOConfig(minibatch_size=4, micro_batch_size=4, rollout_is_cap=cap))
        grads[name] = opt.grads[0]
    # (two runs of the same update differ by ~1e-8 on a CPU: summation order)
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads["plain"], grads["no-engine"]))
    differ = max(float((a - b).abs().max()) for a, b in zip(grads["plain"], grads["tis"]))
    assert same and differ > 1e-3
