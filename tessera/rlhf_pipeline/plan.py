"""Before any process starts: each model's ranks, layout, architecture and weights, checked
(:func:`plan_stage`), and the data each stage reads; building the models on a rank is
:mod:`tessera.rlhf_pipeline.build`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.config import Config, build, parallel_dims
from tessera.config.schema import LoraConfig, OptimizerConfig
from tessera.context import ParallelContext, ParallelDims
from tessera.errors import ConfigError
from tessera.rlhf.data import (
    PreferenceExample,
    PromptExample,
    SFTExample,
    load_preferences,
    load_prompts,
    load_sft,
    read_jsonl,
    sft_from_preferences,
)
from tessera.rlhf.sorting import sorting_files
from tessera.rlhf_pipeline.config import (
    CARD,
    SORTING,
    WEIGHTS,
    DPOStageConfig,
    FrozenLayout,
    GRPOStageConfig,
    ModelSpec,
    PPOStageConfig,
    RMStageConfig,
    SFTStageConfig,
    StageConfig,
)
from tessera.rlhf_pipeline.tokens import stop_ids, tokenizer_of

# ---- the plan: each model's ranks, layout, architecture and weights ------------------------------


@dataclass(frozen=True)
class RolePlan:
    """One model of a stage, resolved: the job ranks holding it, the tessera config and layout
    it runs under, its architecture, the weights it starts from (None: seeded random), whether
    it is a value model, its optimizer (None: frozen), the LoRA adapters it trains (None: the
    whole model trains), and for a reference that is a trained model's own base with its
    adapters off, that model's role (``base_of``; no model of its own is built)."""

    role: str
    ranks: tuple[int, ...]
    config: Config
    dims: ParallelDims
    spec: ModelSpec
    weights: Path | None
    value: bool
    optimizer: OptimizerConfig | None
    lora: LoraConfig | None = None
    base_of: str | None = None

    @property
    def data(self) -> int:
        """Its data-parallel degree (the rows of a batch split into this many shares)."""
        return self.dims.data_size

    def describe(self) -> str:
        axes = [f"{axis}={getattr(self.dims, axis)}" for axis in ("data", "tensor") if getattr(self.dims, axis) > 1]
        if self.dims.tensor > 1:
            axes[-1] += f" ({self.dims.tensor_mode})"
        if self.config.zero.stage:
            axes.append(f"zero-{self.config.zero.stage}")
        if self.config.mixed_precision.dtype != "fp32":
            axes.append(self.config.mixed_precision.dtype)
        if self.optimizer is not None and self.config.gradient_accumulation > 1:
            axes.append(f"accumulation {self.config.gradient_accumulation}")
        where = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {list(self.ranks)}"
        if self.base_of is not None:
            return f"{self.role}: the {self.base_of}'s frozen base with its LoRA adapters off ({where}; no copy of its own)"
        start = f"from {self.weights}" if self.weights is not None else "random"
        frozen = ", frozen" if self.optimizer is None else ""
        adapters = ""
        if self.lora is not None:
            quantized = f", {self.lora.quantize}" if self.lora.quantize != "none" else ""
            adapters = f", LoRA rank {self.lora.rank} on {', '.join(self.lora.targets)} (the rest frozen{quantized})"
        return f"{self.role}: {where}{' (' + ', '.join(axes) + ')' if axes else ''}, {start}{frozen}{adapters}"


def weights_file(init: str, key: str) -> Path:
    """The safetensors file ``init`` names: a stage folder's model.safetensors, or the file."""
    path = Path(init)
    if path.is_dir():
        if not (path / WEIGHTS).is_file():
            raise ConfigError(f"{key}={init!r}: the folder has no {WEIGHTS} (is it a finished stage's folder?)")
        return path / WEIGHTS
    if path.is_file() and path.suffix == ".safetensors":
        return path
    raise ConfigError(f"{key}={init!r} is neither a stage's output folder nor a .safetensors file")


def holds_value_head(weights: Path) -> bool:
    """Whether the safetensors file ``weights`` holds a value model (its head ``score``), read
    from the file's header."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        return "score.weight" in f.keys()


def read_card(weights: Path) -> dict[str, Any] | None:
    """The ``model.json`` beside ``weights`` (a stage folder's), or None."""
    card = weights.parent / CARD
    return json.loads(card.read_text()) if card.is_file() else None


def _architecture(cfg: StageConfig, weights: Path | None, key: str) -> ModelSpec:
    """A model's architecture: its stage folder's (model.json), which must agree with a given
    ``model`` section; else the ``model`` section; else gpt tiny."""
    card = read_card(weights) if weights is not None else None
    if weights is None or card is None:
        return cfg.model if cfg.model is not None else ModelSpec()
    spec = build(ModelSpec, card["model"], f"{weights.parent / CARD}: model.")
    if cfg.model is not None and cfg.model != spec:
        raise ConfigError(
            f"{key}: {weights} was written by a model ({spec.describe()}) other than the config's model section "
            f"({cfg.model.describe()}); drop the model section (the folder's model.json names it) or make them agree"
        )
    return spec


def _tokenizer_key(spec: ModelSpec) -> str:
    return "bytes" if spec.hf_path is None else str(Path(spec.hf_path).resolve())


def _role(
    cfg: StageConfig,
    role: str,
    world: int,
    ranks: list[int] | None,
    layout: FrozenLayout,
    init: str | None,
    value: bool,
    optimizer: OptimizerConfig | None,
    started: str,
    lora: LoraConfig | None = None,
) -> RolePlan:
    key = f"{role}."
    chosen = tuple(ranks) if ranks is not None else tuple(range(world))
    outside = [r for r in chosen if r >= world]
    if outside:
        raise ConfigError(
            f"{key}ranks={list(chosen)}: rank(s) {outside} are outside the job's {world} rank(s) {started}"
        )
    config = layout.tessera_config(cfg.seed, cfg.launch, cfg.comm, key)
    try:
        dims = parallel_dims(config, len(chosen))
    except ConfigError as exc:
        raise ConfigError(f"{key}parallel: {exc} (it has {len(chosen)} rank(s): {list(chosen)}) {started}") from None
    weights = weights_file(init, f"{key}init" if role != "reward" else "reward.from") if init is not None else None
    spec = _architecture(cfg, weights, key)
    adapters = lora if lora is not None and lora.rank else None
    if adapters is not None:
        _check_lora(role, adapters, spec, dims, value)
    return RolePlan(role, chosen, config, dims, spec, weights, value, optimizer, adapters)


def _check_lora(role: str, lora: LoraConfig, spec: ModelSpec, dims: ParallelDims, value: bool) -> None:
    """The adapters a model's layout and kind take (tessera.lora refuses the rest on the ranks)."""
    if dims.tensor > 1 and (spec.hf_path is None or value):
        what = "a value model" if value else "tessera's GPT"
        raise ConfigError(
            f"{role}.lora: adapters on {what} do not yet follow tensor parallelism (its layers split themselves "
            f"before the adapters go on); give {role} data parallelism or ZeRO (parallel.tensor.size=1)"
            + ("" if value else ", or an hf: model, whose adapters split with it")
        )
    if value and "score" in lora.targets:
        raise ConfigError(
            f"{role}.lora.targets names 'score': a value model's head trains whole beside the adapters "
            "(modules_to_save); leave it out of the targets"
        )


def _base_reference(trained: RolePlan, init: str | None, where: str, layout_given: bool) -> RolePlan:
    """The reference of a policy or actor with adapters: its own frozen base with the adapters
    off, on its ranks, under its layout; a reference configured to differ from it is refused."""
    role = trained.role
    keep = f"leave {where} out (the reference is the {role}'s own base with its adapters off), or train the whole "
    keep += f"{role} ({role}.lora.rank=0) against a reference of its own"
    if init is not None:
        given = weights_file(init, "reference.init").resolve()
        if trained.weights is None or given != trained.weights.resolve():
            start = trained.weights if trained.weights is not None else "seeded random weights"
            raise ConfigError(
                f"reference.init={init!r}: with {role}.lora the reference is the {role}'s frozen base ({start}), "
                f"not another model; {keep}"
            )
    if layout_given:
        raise ConfigError(
            f"reference: with {role}.lora the reference runs on the {role}'s ranks, under its layout; {keep}"
        )
    return dataclasses.replace(trained, role="reference", optimizer=None, lora=None, base_of=role)


def _divides(rows: int, parts: int, what: str) -> None:
    if rows % parts:
        raise ConfigError(f"{what}: {rows} rows do not split into {parts} equal parts; make it a multiple of {parts}")


def plan_stage(stage: str, cfg: StageConfig, world: int, started: str = "") -> dict[str, RolePlan]:
    """The stage's models on a job of ``world`` ranks, checked (module docstring): each role's
    :class:`RolePlan`, in the order every rank builds them. ``started``: how the world size was
    chosen, added to the messages it matters to. Raises ConfigError."""
    started = f"({started})" if started else ""
    plans: dict[str, RolePlan] = {}
    loop = cfg.train
    assert isinstance(cfg, SFTStageConfig | RMStageConfig | DPOStageConfig | PPOStageConfig | GRPOStageConfig)
    _data_file(cfg.data.train, "train")  # the files exist (read on the ranks)
    if cfg.data.eval is not None:
        _data_file(cfg.data.eval, "eval")
    if isinstance(cfg, SFTStageConfig | DPOStageConfig):
        p = cfg.policy
        plans["policy"] = _role(cfg, "policy", world, None, p, p.init, False, p.optimizer, started, p.lora)
        if isinstance(cfg, DPOStageConfig) and not cfg.dpo.reference_free and plans["policy"].lora is not None:
            plans["reference"] = _base_reference(plans["policy"], cfg.reference.init, "reference.init", False)
        elif isinstance(cfg, DPOStageConfig) and not cfg.dpo.reference_free:
            init = cfg.reference.init if cfg.reference.init is not None else p.init
            policy = plans["policy"]
            reference = _role(cfg, "reference", world, None, p, init, False, None, started)
            plans["reference"] = dataclasses.replace(reference, config=policy.config, dims=policy.dims)
        trained = plans["policy"]
    elif isinstance(cfg, RMStageConfig):
        r = cfg.reward_model
        plans["reward_model"] = _role(cfg, "reward_model", world, None, r, r.init, True, r.optimizer, started, r.lora)
        trained = plans["reward_model"]
    else:
        assert isinstance(cfg, PPOStageConfig | GRPOStageConfig)
        return _plan_rl(cfg, world, started)
    per_rank = trained.data * trained.config.gradient_accumulation
    _divides(loop.batch_size, per_rank, f"train.batch_size={loop.batch_size} over {trained.role}'s data ranks "
             f"x gradient_accumulation ({trained.data} x {trained.config.gradient_accumulation})")  # fmt: skip
    _same_tokenizer(plans)
    return plans


def _plan_rl(cfg: PPOStageConfig | GRPOStageConfig, world: int, started: str) -> dict[str, RolePlan]:
    plans: dict[str, RolePlan] = {}
    a = cfg.actor
    plans["actor"] = actor = _role(cfg, "actor", world, a.ranks, a, a.init, False, a.optimizer, started, a.lora)
    if actor.dims.tensor > 1 or cfg.actor.zero.stage == 3:
        raise ConfigError(
            "actor: each of its data ranks generates rollouts with the whole model, so its layout may not split "
            "the weights (parallel.tensor.size=1 and zero.stage <= 2); split the critic, reference or reward model"
        )
    if isinstance(cfg, PPOStageConfig):
        c = cfg.critic
        init = c.init if c.init is not None else a.init
        plans["critic"] = _role(cfg, "critic", world, c.ranks, c, init, True, c.optimizer, started, c.lora)
        kl = cfg.ppo.kl_coef > 0 or cfg.ppo.kl_target is not None
    else:
        kl = cfg.grpo.beta > 0
    ref = cfg.reference
    if kl and actor.lora is not None:
        placed = ref.ranks is not None or any(
            getattr(ref, f.name) != getattr(FrozenLayout(), f.name) for f in dataclasses.fields(FrozenLayout)
        )
        plans["reference"] = _base_reference(actor, ref.init, "reference.init, ranks and layout", placed)
    elif kl:
        init = ref.init if ref.init is not None else a.init
        plans["reference"] = _role(cfg, "reference", world, ref.ranks, ref, init, False, None, started)
    if cfg.reward.from_ is not None:
        w = cfg.reward
        plans["reward"] = _role(cfg, "reward", world, w.ranks, w, w.from_, True, None, started)
        weights = plans["reward"].weights
        if weights is None or not holds_value_head(weights):
            raise ConfigError(f"reward.from={w.from_!r} is not a reward model's folder (an rm stage writes one)")
    rows = cfg.train.batch_size * (cfg.grpo.group_size if isinstance(cfg, GRPOStageConfig) else 1)
    rows_of = f"the rollout batch ({rows} rows: train.batch_size" + (
        " x grpo.group_size)" if isinstance(cfg, GRPOStageConfig) else ")"
    )
    options = cfg.ppo if isinstance(cfg, PPOStageConfig) else cfg.grpo
    _divides(rows, options.minibatches, f"{rows_of} over minibatches={options.minibatches}")
    for plan in plans.values():
        _divides(rows, plan.data, f"{rows_of} over the {plan.role}'s {plan.data} data ranks")
        if plan.optimizer is not None:
            each = rows // options.minibatches
            accumulation = plan.config.gradient_accumulation
            _divides(each, plan.data * accumulation, f"a minibatch ({each} rows) over the {plan.role}'s data ranks "
                     f"x gradient_accumulation ({plan.data} x {accumulation})")  # fmt: skip
    _same_tokenizer(plans)
    stop_ids(cfg.generation, tokenizer_of(actor.spec))  # each stop string is one token
    return plans


def _same_tokenizer(plans: Mapping[str, RolePlan]) -> None:
    keys = {role: _tokenizer_key(plan.spec) for role, plan in plans.items()}
    if len(set(keys.values())) > 1:
        shown = ", ".join(f"{role}: {plan.spec.describe()}" for role, plan in plans.items())
        raise ConfigError(f"the models of a stage must share a tokenizer, and these do not: {shown}")


# ---- data ---------------------------------------------------------------------------------------


def _data_file(given: str, split: str) -> Path:
    if given == SORTING:
        files = sorting_files()
        return files.train if split == "train" else files.heldout
    path = Path(given)
    if not path.is_file():
        raise ConfigError(f"data.{split}={given!r}: no such file (give a JSONL file, or 'sorting')")
    return path


def sft_examples(given: str, split: str) -> list[SFTExample]:
    """SFT examples of a file with ``response`` fields, or a preference file's chosen answers."""
    path = _data_file(given, split)
    first = read_jsonl(path)[:1]
    if first and "response" not in first[0] and "chosen" in first[0]:
        return sft_from_preferences(load_preferences(path))
    return load_sft(path)


def preference_examples(given: str, split: str) -> list[PreferenceExample]:
    return load_preferences(_data_file(given, split))


def prompt_examples(given: str, split: str) -> list[PromptExample]:
    return load_prompts(_data_file(given, split))


def index_batches(rows: int, size: int, shuffle: bool, seed: int) -> Iterator[list[int]]:
    """Endless batches of ``size`` row indices of ``rows``: each epoch a fresh seeded order (the
    same on every rank), its last incomplete batch dropped."""
    if rows < size:
        raise ConfigError(f"train.batch_size={size} is larger than the {rows} training rows")
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(rows, generator=generator).tolist() if shuffle else list(range(rows))
        for start in range(0, rows - size + 1, size):
            yield order[start : start + size]


def data_share(rows: Sequence[int], ctx: ParallelContext) -> list[int]:
    """This rank's contiguous share of ``rows`` (its data index's; tensor ranks of one data index
    take the same rows)."""
    parts, index = ctx.size("data"), ctx.local_rank("data")
    each = len(rows) // parts
    return list(rows[index * each : (index + 1) * each])


def chunks(rows: Sequence[int], count: int) -> list[list[int]]:
    """``rows`` cut into ``count`` contiguous parts as equal as can be."""
    bounds = [round(i * len(rows) / count) for i in range(count + 1)]
    return [list(rows[bounds[i] : bounds[i + 1]]) for i in range(count)]
