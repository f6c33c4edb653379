"""The losses and advantages of language-model alignment, as pure functions of tensors.

Supervised fine-tuning (:func:`sft_loss`), reward modelling (:func:`pairwise_reward_loss`), PPO
(:func:`ppo_policy_loss`, :func:`ppo_value_loss`; its rewards, advantages and KL controllers are
in :mod:`tessera.rlhf.advantages`), DPO (:func:`dpo_loss`) and GRPO (:func:`grpo_loss`; its
advantages: :func:`~tessera.rlhf.advantages.grpo_advantages`). Log-probabilities of tokens and
masked reductions: :mod:`tessera.rlhf.tokens`. None of
them touches a model, an optimizer or a process group: a trainer computes log-probabilities and
values with its model and hands the tensors here.

Conventions shared by every function:

* Per-token tensors are ``[B, T]``: ``B`` sequences, ``T`` response (completion) tokens. Position
  ``t`` holds the quantity of response token ``t``, for example ``log pi(y_t | x, y_<t)``.
* ``mask`` is a bool or 0/1 tensor of the same shape, true (non-zero) at real response tokens.
  Rows are right-padded where a function says so (:func:`gae`, :func:`per_token_rewards`): the
  true entries of a row come first. Whatever sits in a padded slot, however large, changes neither
  the result nor the gradients; padded slots of per-token outputs are 0.
* The arithmetic is float32 for bfloat16, float16 and float32 inputs (float64 stays float64), and
  results come back in that dtype.
* Targets do not carry gradients: old log-probs, reference log-probs, advantages, returns and old
  values are detached inside, so a loss's gradient reaches only the current policy's log-probs
  (or the current values).
* Statistics are detached 0-d tensors, so reading them costs no device synchronisation until the
  caller asks for ``.item()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.rlhf.advantages import kl_estimate
from tessera.rlhf.tokens import (
    bool_mask,
    check_per_sequence,
    check_per_token,
    compute_dtype,
    masked_mean,
    masked_sum,
    shape_of,
    token_logprobs,
    zero_padding,
)

__all__ = [
    "DPO_LOSS_TYPES",
    "GRPO_LOSS_TYPES",
    "dpo_loss",
    "grpo_loss",
    "pairwise_reward_loss",
    "ppo_policy_loss",
    "ppo_value_loss",
    "sft_loss",
]

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo")


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``labels`` under ``logits``, averaged over the tokens where ``loss_mask``
    is true: ``-sum_{b,t in mask} log p(labels[b,t]) / count(mask)``, a 0-d float32 tensor.

    ``logits [B, T, V]``, ``labels [B, T]``, ``loss_mask [B, T]``. The labels are already shifted:
    ``logits[:, t]`` is the model's prediction for ``labels[:, t]``. For a causal LM run on
    ``input_ids [B, L]`` pass ``logits[:, :-1]``, ``input_ids[:, 1:]`` and ``response_mask[:, 1:]``
    (true at response tokens, false at prompt and padding), which is what Hugging Face's
    ``labels`` with -100 at prompt tokens compute. Each response token weighs the same, whichever
    sequence it is in (the token-level mean). Labels in masked-out slots are never read (-100 is
    fine there). An all-false mask gives 0."""
    if logits.dim() != 3:
        raise ValueError(f"sft_loss: logits must be [B, T, V] (3-D), got shape {shape_of(logits)}")
    check_per_token("sft_loss", ("labels", labels), ("loss_mask", loss_mask))
    if labels.shape != logits.shape[:2]:
        raise ValueError(
            f"sft_loss: labels has shape {shape_of(labels)} but logits has shape {shape_of(logits)}; "
            "labels must be [B, T] with the logits' B and T"
        )
    mask = bool_mask(loss_mask)
    safe_labels = torch.where(mask, labels, torch.zeros((), dtype=labels.dtype, device=labels.device))
    return -masked_mean(token_logprobs(logits, safe_labels), mask)


def pairwise_reward_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Bradley-Terry loss of a reward model on preference pairs: ``[B], [B] -> (loss, accuracy)``.

    ``loss = mean_b -log sigmoid(chosen_b - rejected_b - margin_b)`` (InstructGPT; the margin is
    Llama 2's, larger for pairs the labellers ranked more clearly; None means 0). ``margin`` is a
    number or a ``[B]`` tensor. ``accuracy`` is the detached fraction of pairs with
    ``chosen > rejected`` (the margin does not enter it). Both are 0-d float32 tensors."""
    if chosen.dim() != 1:
        raise ValueError(f"pairwise_reward_loss: chosen must be [B] (1-D), got shape {shape_of(chosen)}")
    check_per_sequence("pairwise_reward_loss", "rejected", rejected, chosen.shape[0])
    difference = compute_dtype(chosen) - compute_dtype(rejected)
    if margin is not None:
        if isinstance(margin, torch.Tensor):
            check_per_sequence("pairwise_reward_loss", "margin", margin, chosen.shape[0])
            margin = margin.detach().to(difference.dtype)
        difference = difference - margin
    loss = -F.logsigmoid(difference).mean()
    accuracy = (chosen.detach() > rejected.detach()).to(difference.dtype).mean()
    return loss, accuracy


# --- PPO ----------------------------------------------------------------------------------------


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate objective, as a loss: ``[B, T]`` inputs -> ``(loss, stats)``.

    With ``rho_t = exp(logprobs_t - old_logprobs_t)`` and the advantage ``A_t``::

        loss = masked_mean( max(-A_t * rho_t, -A_t * clip(rho_t, 1 - eps, 1 + eps)) )

    the mean over all real tokens of the batch (each token weighs the same). ``old_logprobs`` and
    ``advantages`` are detached. ``stats`` (detached 0-d tensors, over real tokens):

    * ``"clipfrac"``: the fraction of tokens where the clipped term is the larger (so its gradient
      is 0);
    * ``"approx_kl"``: ``0.5 * masked_mean((logprobs - old_logprobs)**2)``, the k2 estimate of
      ``KL(pi_old || pi)`` that TRL's PPO and OpenAI's PPO2 report;
    * ``"ratio_mean"``: the mean of ``rho``."""
    check_per_token(
        "ppo_policy_loss",
        ("logprobs", logprobs),
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("mask", mask),
    )
    if clip_eps <= 0:
        raise ValueError(f"ppo_policy_loss: clip_eps must be > 0, got {clip_eps}")
    mask = bool_mask(mask)
    log_ratio = zero_padding(compute_dtype(logprobs) - compute_dtype(old_logprobs.detach()), mask)
    advantages = zero_padding(compute_dtype(advantages.detach()), mask)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), mask),
            "approx_kl": 0.5 * masked_mean(log_ratio.square(), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_value: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's value loss with the value clipping of OpenAI's PPO2 and TRL: ``[B, T]`` inputs ->
    ``(loss, stats)``::

        V_clip = old_values + clip(values - old_values, -c, c)
        loss   = 0.5 * masked_mean( max((values - returns)**2, (V_clip - returns)**2) )

    With ``clip_value=None`` it is ``0.5 * masked_mean((values - returns)**2)``. ``old_values`` and
    ``returns`` are detached, so the gradient reaches ``values`` only. ``stats["clipfrac"]``: the
    detached fraction of real tokens where the clip took effect (``|values - old_values| > c``)
    and the clipped error is the larger (0 without clipping). TRL and PPO2 count
    ``clipped > unclipped`` alone; inside the clip range ``V_clip`` equals ``values`` only up to
    rounding, so theirs also counts tokens where the rounding of ``old_values + (values -
    old_values)`` happens to land farther from the return, and varies with the CPU's kernels."""
    check_per_token(
        "ppo_value_loss", ("values", values), ("old_values", old_values), ("returns", returns), ("mask", mask)
    )
    if clip_value is not None and clip_value <= 0:
        raise ValueError(f"ppo_value_loss: clip_value must be > 0 or None (no clipping), got {clip_value}")
    mask = bool_mask(mask)
    values = zero_padding(compute_dtype(values), mask)
    old_values = zero_padding(compute_dtype(old_values.detach()), mask)
    returns = zero_padding(compute_dtype(returns.detach()), mask)
    unclipped = (values - returns).square()
    if clip_value is None:
        return 0.5 * masked_mean(unclipped, mask), {"clipfrac": values.new_zeros(())}
    clipped_values = old_values + (values - old_values).clamp(-clip_value, clip_value)
    clipped = (clipped_values - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        took_effect = (values - old_values).abs() > clip_value
        clipfrac = masked_mean((took_effect & (clipped > unclipped)).to(values.dtype), mask)
    return loss, {"clipfrac": clipfrac}


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct preference optimisation and its variants, per pair: ``[B]`` sequence log-probs ->
    ``(losses [B], chosen_rewards [B], rejected_rewards [B])``.

    The inputs are each response's log-probability under the policy and the frozen reference
    (usually :func:`masked_sum` of :func:`token_logprobs` over the response). With the margin
    ``h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)``:

    * ``"sigmoid"`` (DPO, Rafailov et al. 2023), with the conservative label smoothing ``e`` of
      cDPO (the preference label is wrong with probability ``e``, ``0 <= e < 0.5``)::

          loss = -(1 - e) * log sigmoid(beta * h) - e * log sigmoid(-beta * h)

    * ``"hinge"`` (SLiC, Zhao et al. 2023): ``relu(1 - beta * h)``;
    * ``"ipo"`` (Azar et al. 2023): ``(h - 1 / (2 * beta))**2``. IPO is defined on per-token
      averages: pass the log-probs divided by each response's token count (:func:`masked_mean`),
      as TRL and the IPO authors do.

    ``reference_free=True`` takes the reference log-probs as 0 (the reference arguments may then be
    None). ``chosen_rewards = beta * (policy_chosen - ref_chosen)`` and likewise for rejected: DPO's
    implicit rewards, detached. The reference log-probs are detached too, so the gradient reaches
    the policy log-probs only. Take ``losses.mean()`` for the batch loss."""
    where = "dpo_loss"
    if policy_chosen_logps.dim() != 1:
        raise ValueError(f"{where}: policy_chosen_logps must be [B] (1-D), got shape {shape_of(policy_chosen_logps)}")
    batch = policy_chosen_logps.shape[0]
    check_per_sequence(where, "policy_rejected_logps", policy_rejected_logps, batch)
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"{where}: loss_type must be one of {list(DPO_LOSS_TYPES)}, got {loss_type!r}")
    if beta <= 0:
        raise ValueError(f"{where}: beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"{where}: label_smoothing must lie in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"{where}: label_smoothing applies to loss_type='sigmoid' only, not {loss_type!r}")
    chosen = compute_dtype(policy_chosen_logps)
    rejected = compute_dtype(policy_rejected_logps)
    if reference_free:
        ref_chosen = ref_rejected = torch.zeros_like(chosen)
    else:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"{where}: the reference log-probs are None; pass them, or reference_free=True")
        check_per_sequence(where, "ref_chosen_logps", ref_chosen_logps, batch)
        check_per_sequence(where, "ref_rejected_logps", ref_rejected_logps, batch)
        ref_chosen = compute_dtype(ref_chosen_logps.detach()).to(chosen.dtype)
        ref_rejected = compute_dtype(ref_rejected_logps.detach()).to(chosen.dtype)
    chosen_logratio = chosen - ref_chosen
    rejected_logratio = rejected - ref_rejected
    margin = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * margin)
    else:  # ipo
        losses = (margin - 1.0 / (2.0 * beta)).square()
    return losses, beta * chosen_logratio.detach(), beta * rejected_logratio.detach()


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    beta: float = 0.04,
    loss_type: str = "grpo",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's loss: ``logprobs, old_logprobs, ref_logprobs, mask [B, T]``, ``advantages [B]`` ->
    ``(loss, stats)``.

    Each sequence's advantage ``A_b`` applies to all its tokens. Per token, with
    ``rho = exp(logprobs - old_logprobs)`` and ``d = ref_logprobs - logprobs``::

        l_{b,t} = -min(rho * A_b, clip(rho, 1 - eps, 1 + eps) * A_b) + beta * (exp(d) - d - 1)

    the last term being the k3 estimate of ``KL(pi || pi_ref)`` (left out when ``beta == 0``; then
    ``ref_logprobs`` may be None). ``old_logprobs=None`` means one policy update per generation:
    ``old = logprobs.detach()`` (so ``rho = 1`` with the right gradient). The tokens are then
    aggregated as ``loss_type`` says (TRL's definitions):

    * ``"grpo"``: the mean over each sequence's tokens, then the mean over sequences (DeepSeekMath);
    * ``"bnpo"``: the mean over all real tokens of the batch;
    * ``"dr_grpo"``: the sum over all real tokens divided by ``B * T`` (Dr. GRPO's constant
      normaliser, ``T`` standing for the maximum completion length).

    ``old_logprobs``, ``ref_logprobs`` and ``advantages`` are detached. ``stats`` (detached 0-d
    tensors, means over real tokens): ``"clipfrac"`` (tokens where clipping took effect: ``rho < 1 -
    eps`` with ``A < 0`` or ``rho > 1 + eps`` with ``A > 0``), ``"ratio_mean"``, and ``"kl"`` (the mean
    k3 KL) when ``beta != 0``."""
    where = "grpo_loss"
    check_per_token(
        where, ("logprobs", logprobs), ("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs), ("mask", mask)
    )
    check_per_sequence(where, "advantages", advantages, logprobs.shape[0])
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"{where}: loss_type must be one of {list(GRPO_LOSS_TYPES)}, got {loss_type!r}")
    if clip_eps <= 0:
        raise ValueError(f"{where}: clip_eps must be > 0, got {clip_eps}")
    if beta < 0:
        raise ValueError(f"{where}: beta must be >= 0, got {beta}")
    if beta != 0 and ref_logprobs is None:
        raise ValueError(f"{where}: ref_logprobs is None but beta={beta}; pass the reference log-probs, or beta=0")
    mask = bool_mask(mask)
    logprobs = zero_padding(compute_dtype(logprobs), mask)
    old = logprobs.detach() if old_logprobs is None else zero_padding(compute_dtype(old_logprobs.detach()), mask)
    advantage = compute_dtype(advantages.detach()).unsqueeze(1)
    ratio = torch.exp(logprobs - old)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantage
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if beta != 0 and ref_logprobs is not None:  # checked above: beta != 0 comes with ref_logprobs
        ref = zero_padding(compute_dtype(ref_logprobs.detach()), mask)
        kl = kl_estimate(logprobs, ref, "k3")
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = masked_mean(per_token, mask, dim=1).mean()
    elif loss_type == "bnpo":
        loss = masked_mean(per_token, mask)
    else:  # dr_grpo
        loss = masked_sum(per_token, mask) / (per_token.shape[0] * per_token.shape[1])
    with torch.no_grad():
        clipped_region = ((ratio < 1.0 - clip_eps) & (advantage < 0)) | ((ratio > 1.0 + clip_eps) & (advantage > 0))
        stats = {
            "clipfrac": masked_mean(clipped_region.to(ratio.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
        if kl is not None:
            stats["kl"] = masked_mean(kl, mask)
    return loss, stats
