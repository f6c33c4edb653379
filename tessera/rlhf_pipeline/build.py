"""Building a ``tessera rlhf`` stage's models on a rank, from its plan
(:mod:`tessera.rlhf_pipeline.plan`): each role's context, model, weights, LoRA adapters and
engine (:class:`Built`), and the rule rewards and stop penalty that wrap them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tessera
from tessera import lora
from tessera.checkpoint import load_full_state_dict, load_weights
from tessera.config.schema import LoraConfig
from tessera.context import ParallelContext, get_context
from tessera.errors import ConfigError
from tessera.lora.quant import quantize
from tessera.rlhf.adapters import AdaptersOff
from tessera.rlhf.experience import Frozen, text_reward
from tessera.rlhf.models import ValueModel, value_model
from tessera.rlhf_pipeline.config import ModelSpec
from tessera.rlhf_pipeline.plan import RolePlan
from tessera.session import current_config, set_session


def causal_lm(spec: ModelSpec) -> nn.Module:
    """A causal LM of ``spec`` with seeded random weights (an hf: folder's own when it has them),
    built under the current context (its tensor layers split themselves)."""
    if spec.hf_path is None:
        from tessera.models import gpt

        return gpt(spec.preset, **spec.options)
    from tessera.hf.train import find_causal_lm

    lm = find_causal_lm(spec.hf_path, spec.options)
    if lm.weights:
        model: nn.Module = lm.cls.from_pretrained(str(lm.path), dtype=torch.float32, **spec.options)  # type: ignore[attr-defined]
        return model
    import transformers

    built: nn.Module = transformers.AutoModelForCausalLM.from_config(lm.config, dtype=torch.float32)
    return built


def load_into(model: nn.Module, weights: Path, role: str) -> None:
    """``weights`` (a full state) into ``model`` in its layout: whole, or, for a value model given
    a causal LM's weights, into its backbone."""
    state = load_weights(weights)
    holds_head = "score.weight" in state
    try:
        if isinstance(model, ValueModel) and not holds_head:
            model.load_backbone(state)
        elif holds_head and not isinstance(model, ValueModel):
            raise ConfigError(
                f"{role}: {weights} holds a value model (a reward model or critic), not a causal LM; give an sft, "
                "dpo, ppo or grpo folder"
            )
        else:
            load_full_state_dict(model, state)
    except (KeyError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{role}: {weights} does not fit the model: {exc}") from None


def put_adapters(model: nn.Module, cfg: LoraConfig, value: bool) -> None:
    """``cfg``'s adapters on ``model`` (its weights loaded), the rest frozen, the adapted layers'
    bases quantized as ``cfg.quantize`` says. A value model's head ``score`` is no target of
    ``"all-linear"`` and trains whole (``modules_to_save``)."""
    targets, saved = tuple(cfg.targets), tuple(cfg.modules_to_save)
    if value:
        if targets == ("all-linear",):
            targets = tuple(name for name in lora.linear_layers(model) if name != "score")
        saved = tuple(dict.fromkeys((*saved, "score")))
    lora.apply(model, lora.LoraOptions(cfg.rank, cfg.alpha, cfg.dropout, targets, saved, cfg.init))
    if cfg.quantize != "none":
        quantize(model, cfg.quantize, double_quant=cfg.double_quant)


class StopPenalty(nn.Module):
    """A reward model whose value at every token other than a stop token is ``penalty`` lower:
    a row's score, read at its last token, drops by ``penalty`` when its response was cut off
    before a stop token (``reward.missing_stop_penalty``). ``model``: a value model, or a frozen
    one (:class:`~tessera.rlhf.experience.Frozen`, an engine's forward under its layout)."""

    def __init__(self, model: Callable[..., torch.Tensor], stops: Sequence[int], penalty: float) -> None:
        super().__init__()
        self.model, self.penalty = model, penalty
        self.stops = tuple(int(t) for t in stops)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        values = self.model(input_ids, attention_mask)
        unstopped = ~torch.isin(input_ids, torch.tensor(self.stops, device=input_ids.device))
        return values - self.penalty * unstopped.to(values.dtype)


def rule_reward(rule: Callable[[str, str], float], tokenizer: Any, stops: Sequence[int], penalty: float) -> Any:
    """The job's reward from a rule on text, ``penalty`` lower for a response that does not end
    with one of ``stops``."""
    scored = text_reward(rule, tokenizer)
    if not penalty:
        return scored
    ends = set(stops)

    def score(prompt: Sequence[int], response: Sequence[int]) -> float:
        stopped = bool(response) and response[-1] in ends
        return scored(prompt, response) - (0.0 if stopped else penalty)

    return score


class Built:
    """A stage's models on this rank: the contexts of every role (built collectively, in the
    plan's order) and what this rank holds of them."""

    def __init__(self, plans: Mapping[str, RolePlan]) -> None:
        self.plans = plans
        self.job = get_context()
        self.job_config = current_config()
        self.contexts: dict[str, ParallelContext | None] = {}
        self.engines: dict[str, Any] = {}
        for role, plan in plans.items():  # collective over the job: every rank, the same order
            if plan.base_of is not None or (role == "reference" and "policy" in plans):
                self.contexts[role] = self.contexts[plan.base_of or "policy"]  # DPO's, or the base: beside it
                continue
            self.contexts[role] = ParallelContext.on_ranks(
                plan.ranks, plan.dims, device=self.job.device, seed=plan.config.seed
            )

    def module(self, role: str, *, head_std: float | None = None) -> nn.Module | None:
        """The role's model built on this rank under its context (None where it is not held),
        its weights loaded, on the context's device."""
        plan, ctx = self.plans[role], self.contexts[role]
        if ctx is None:
            return None
        set_session(ctx, plan.config)  # tessera's layers split themselves for the current context
        try:
            torch.manual_seed(plan.config.seed)  # the same random weights on every rank
            model = causal_lm(plan.spec)
            if plan.value:
                model = value_model(model, head_std=head_std, head_seed=plan.config.seed)
            if plan.weights is not None:
                load_into(model, plan.weights, role)
            if plan.lora is not None:
                try:
                    put_adapters(model, plan.lora, plan.value)
                except ConfigError as exc:  # a target or rank this model does not have: name the model
                    raise ConfigError(f"{role}: {exc}") from None
        finally:
            set_session(self.job, self.job_config)
        return model.to(ctx.device)

    def engine(self, role: str, *, head_std: float | None = None) -> Any:
        """The role's engine on this rank (None where it is not held): its layout applied, its
        optimizer built (a frozen model's never steps: ``tessera.initialize`` needs one)."""
        model = self.module(role, head_std=head_std)
        if model is None:
            self.engines[role] = None
            return None
        from tessera.train import build_optimizer

        plan = self.plans[role]
        if plan.optimizer is not None:
            optimizer = build_optimizer(model, plan.optimizer)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # no state: it never steps
        engine, _, _, _ = tessera.initialize(model, optimizer, ctx=self.contexts[role], config=plan.config)
        self.engines[role] = engine
        return engine

    def frozen(self, role: str) -> Frozen | AdaptersOff | None:
        """The role's frozen model on this rank (None where it is not held), run through its
        engine's forward: ZeRO-3's pieces, tensor-parallel blocks, mixed precision. A reference
        that is a trained model's base (``base_of``; that model's engine built first) is that
        engine with its adapters off."""
        base_of = self.plans[role].base_of
        if base_of is not None:
            trained = self.engines[base_of]
            return AdaptersOff(trained) if trained is not None else None
        engine = self.engine(role)
        return Frozen(engine) if engine is not None else None
