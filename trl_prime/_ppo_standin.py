"""TEMPORARY stand-in for the PPO math the lead adds to trl_prime.functional; deleted after the merge."""

from __future__ import annotations

import torch

from trl_prime import functional as F


def ppo_token_rewards(process_rewards, outcome_rewards, mask, *, process_coef=1.0, outcome_coef=1.0):
    m = mask.bool()
    last = F.last_token_mask(m)
    r = torch.where(m, process_coef * process_rewards.float(), torch.zeros_like(process_rewards.float()))
    r = r + outcome_coef * torch.where(last, torch.nan_to_num(outcome_rewards.float()).unsqueeze(1), 0.0)
    return torch.where(torch.isnan(outcome_rewards).unsqueeze(1), torch.full_like(r, torch.nan), r)


def gae_advantages(rewards, values, mask, *, gamma=1.0, lam=1.0, whiten=False):
    m = mask.bool()
    bad = ((torch.isnan(rewards) | torch.isnan(values)) & m).any(-1)
    r = torch.where(m & ~bad.unsqueeze(1), rewards.float(), 0.0)
    v = torch.where(m & ~bad.unsqueeze(1), values.float(), 0.0)
    B, T = r.shape
    adv = torch.zeros_like(r)
    last_gae = torch.zeros(B, device=r.device)
    next_v = torch.zeros(B, device=r.device)
    for t in reversed(range(T)):
        mt = m[:, t] & ~bad
        delta = r[:, t] + gamma * next_v - v[:, t]
        g = delta + gamma * lam * last_gae
        adv[:, t] = torch.where(mt, g, 0.0)
        last_gae = torch.where(mt, g, last_gae)
        next_v = torch.where(mt, v[:, t], next_v)
    returns = torch.where(m & ~bad.unsqueeze(1), adv + v, 0.0)
    if whiten:
        w = m & ~bad.unsqueeze(1)
        if int(w.sum()) >= 2:
            adv = torch.where(w, F.masked_whiten(adv, w), 0.0)
    return adv, returns


def implicit_prm_values(process_rewards, mask):
    m = mask.bool()
    r = torch.where(m, process_rewards.float(), 0.0)
    return torch.where(m, r.cumsum(-1) - r, 0.0)


def clipped_value_loss(values, old_values, returns, mask, *, cliprange_value=0.2, normalizer=None):
    m = mask.to(values.dtype)
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    a, b = (values - returns) ** 2, (clipped - returns) ** 2
    n = normalizer if normalizer is not None else m.sum().clamp(min=1)
    loss = 0.5 * (torch.maximum(a, b) * m).sum() / n
    clipfrac = ((b > a).to(values.dtype) * m).sum() / m.sum().clamp(min=1)
    return loss, clipfrac.detach()


def explained_variance(values, returns, mask):
    m = mask.bool()
    v, r = values[m].float(), returns[m].float()
    if r.numel() < 2:
        return torch.tensor(float("nan"))
    return 1 - (r - v).var() / r.var()


_orig_prime_advantages = F.prime_advantages


def prime_advantages(process_rewards, outcome_rewards, mask, group_ids=None, *, estimator="rloo", **options):
    if estimator != "ppo":
        return _orig_prime_advantages(
            process_rewards, outcome_rewards, mask, group_ids, estimator=estimator, **options
        )
    rewards = ppo_token_rewards(
        process_rewards,
        outcome_rewards,
        mask,
        process_coef=options.get("process_coef", 1.0),
        outcome_coef=options.get("outcome_coef", 1.0),
    )
    return gae_advantages(
        rewards,
        options["values"],
        mask,
        gamma=options.get("gamma", 1.0),
        lam=options.get("lam", 1.0),
        whiten=options.get("whiten", False),
    )[0]


if not hasattr(F, "gae_advantages"):
    F.prime_advantages = prime_advantages
    F.ESTIMATORS = (*F.ESTIMATORS, "ppo")
    F.PRIME_VALUES = ("critic", "implicit_prm")
    for _fn in (ppo_token_rewards, gae_advantages, implicit_prm_values, clipped_value_loss, explained_variance):
        setattr(F, _fn.__name__, _fn)
