"""The advantages of PPO and GRPO: rewards per token with a KL penalty against the reference
model, generalized advantage estimation, the KL coefficient's controllers, and GRPO's
group-relative advantages. Conventions as in :mod:`tessera.rlhf.losses`."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tessera.rlhf.tokens import (
    bool_mask,
    check_per_sequence,
    check_per_token,
    check_right_padded,
    check_same_shape,
    compute_dtype,
    shape_of,
    zero_padding,
)

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "gae",
    "grpo_advantages",
    "kl_estimate",
    "per_token_rewards",
]

KL_ESTIMATORS = ("k1", "abs", "mse", "k3")


@torch.no_grad()
def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over each row's response tokens.

    ``rewards, values, mask [B, T] -> (advantages [B, T], returns [B, T])``, float32, no gradient.
    With ``V_{t+1} = 0`` after a row's last real token (the episode ends there)::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t               (the value target)

    The mask must be right-padded; padded slots of both outputs are 0 and their inputs are never
    read. The loop runs over ``T``, batched over rows. The advantages are not whitened: call
    :func:`masked_whiten` on them if the recipe does (TRL and InstructGPT-style PPO do)."""
    check_per_token("gae", ("rewards", rewards), ("values", values), ("mask", mask))
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gae: gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    mask = bool_mask(mask)
    check_right_padded("gae", mask)
    rewards = zero_padding(compute_dtype(rewards), mask)
    values = zero_padding(compute_dtype(values), mask)
    length = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    # Padded slots hold r = V = 0, so the value after a row's last real token reads as 0 and the
    # recursion gives 0 in every padded slot: no per-row bookkeeping is needed.
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = next_advantage
        next_value = values[:, t]
    return advantages, zero_padding(advantages + values, mask)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from log-probs of tokens sampled from ``pi``.

    With ``d = logprobs - ref_logprobs`` (same shape, any shape), ``kind`` is one of (Schulman,
    "Approximating KL divergence", 2020):

    * ``"k1"``: ``d`` (unbiased, can be negative);
    * ``"abs"``: ``|d|``;
    * ``"mse"``: ``0.5 * d**2`` (the k2 estimator: biased, low variance, never negative);
    * ``"k3"``: ``exp(-d) - 1 + d``, i.e. ``exp(ref - logp) - (ref - logp) - 1`` (unbiased and
      never negative).

    ``ref_logprobs`` is detached; the result is float32 and differentiable in ``logprobs``."""
    check_same_shape("kl_estimate", ("logprobs", logprobs), ("ref_logprobs", ref_logprobs))
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimate: kind must be one of {list(KL_ESTIMATORS)}, got {kind!r}")
    difference = compute_dtype(logprobs) - compute_dtype(ref_logprobs.detach())
    if kind == "k1":
        return difference
    if kind == "abs":
        return difference.abs()
    if kind == "mse":
        return 0.5 * difference.square()
    return torch.expm1(-difference) + difference  # k3, with expm1 for accuracy near d = 0


@torch.no_grad()
def per_token_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
    clip_score: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token rewards: a KL penalty at every response token and the reward model's score
    at the last one (InstructGPT). TRL's ``PPOTrainer`` differs in one place: it adds the score
    one slot after the last response token when the row has room for it.

    ``scores [B]``, ``logprobs, ref_logprobs, mask [B, T] -> (rewards [B, T], kl [B, T])``,
    float32, no gradient::

        kl_t      = kl_estimate(logprobs, ref_logprobs, kind)_t
        rewards_t = -kl_coef * kl_t + [t == last real token of the row] * clip(score, -c, c)

    where ``c = clip_score`` (no clipping when None). The mask must be right-padded and every row
    must have at least one real token; padded slots of both outputs are 0."""
    check_per_token("per_token_rewards", ("logprobs", logprobs), ("ref_logprobs", ref_logprobs), ("mask", mask))
    check_per_sequence("per_token_rewards", "scores", scores, logprobs.shape[0])
    if kl_coef < 0:
        raise ValueError(f"per_token_rewards: kl_coef must be >= 0, got {kl_coef}")
    if clip_score is not None and clip_score <= 0:
        raise ValueError(f"per_token_rewards: clip_score must be > 0 or None, got {clip_score}")
    mask = bool_mask(mask)
    check_right_padded("per_token_rewards", mask)
    lengths = mask.sum(dim=1)
    if bool((lengths == 0).any()):
        empty = torch.nonzero(lengths == 0).flatten().tolist()
        raise ValueError(f"per_token_rewards: rows {empty} have no response token to put their score on")
    kl = zero_padding(kl_estimate(zero_padding(logprobs, mask), zero_padding(ref_logprobs, mask), kind), mask)
    rewards = -kl_coef * kl
    score = compute_dtype(scores)
    if clip_score is not None:
        score = score.clamp(-clip_score, clip_score)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, lengths - 1] += score.to(rewards.dtype)
    return rewards, kl


class KLController(ABC):
    """The KL penalty coefficient of PPO: ``value`` now, ``update`` after each rollout batch, and
    ``state_dict``/``load_state_dict`` so a resumed run continues with the coefficient it had."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"{type(self).__name__}: the KL coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    @abstractmethod
    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Take the measured KL of the last ``n_steps`` samples into account."""

    def state_dict(self) -> dict[str, float]:
        """The state to save with a checkpoint: ``{"value": coefficient}``."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient saved by :meth:`state_dict`; other keys are an error."""
        if set(state) != {"value"}:
            unknown = sorted(set(state) - {"value"})
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: expected the key 'value' only, got "
                f"{sorted(state)}" + (f" (unknown: {unknown})" if unknown else "")
            )
        value = float(state["value"])
        if value < 0:
            raise ValueError(f"{type(self).__name__}.load_state_dict: value must be >= 0, got {value}")
        self.value = value


class FixedKLController(KLController):
    """A KL coefficient that never changes: ``update`` leaves ``value`` as it is."""

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """No change: the coefficient is fixed."""


class AdaptiveKLController(KLController):
    """The adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning Language Models from
    Human Preferences"), which steers the measured KL towards ``target``::

        error  = clip(current_kl / target - 1, -0.2, 0.2)
        value *= 1 + error * n_steps / horizon

    ``current_kl`` is the mean per-sequence KL of the rollout batch, ``n_steps`` the number of
    samples it covered; ``horizon`` sets how fast the coefficient moves."""

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        super().__init__(init_coef)
        if target <= 0:
            raise ValueError(f"AdaptiveKLController: target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Move ``value`` by the clipped proportional error of ``current_kl`` against the target."""
        if n_steps < 0:
            raise ValueError(f"AdaptiveKLController.update: n_steps must be >= 0, got {n_steps}")
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def grpo_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's group-relative advantages: ``rewards [N] -> advantages [N]``, float32, no gradient.

    The rewards come in consecutive groups of ``group_size`` completions of one prompt
    (``N = prompts * group_size``). Within a group ``g``::

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     (scale=True, DeepSeekMath)
        A_i =  r_i - mean_g(r)                         (scale=False, Dr. GRPO)

    where ``std_g`` is the unbiased (Bessel-corrected, ``/ (G - 1)``) standard deviation, as
    ``torch.std`` and TRL's ``GRPOTrainer`` (``nanstd``) compute it. A group whose rewards are all
    equal gets advantage 0."""
    if rewards.dim() != 1:
        raise ValueError(f"grpo_advantages: rewards must be [N] (1-D), got shape {shape_of(rewards)}")
    if group_size < 2:
        raise ValueError(
            f"grpo_advantages: group_size must be >= 2 (one completion has no group to compare with), got {group_size}"
        )
    if rewards.shape[0] % group_size:
        raise ValueError(
            f"grpo_advantages: {rewards.shape[0]} rewards do not split into groups of {group_size}; "
            "N must be prompts * group_size"
        )
    if eps < 0:
        raise ValueError(f"grpo_advantages: eps must be >= 0, got {eps}")
    grouped = compute_dtype(rewards.detach()).view(-1, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    return advantages.view(-1)
