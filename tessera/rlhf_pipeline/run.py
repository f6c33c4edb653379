"""The stages' runs on each rank: the training loops and evaluation (what they write and print
is :mod:`tessera.rlhf_pipeline.output`); :func:`main` is what every rank of ``tessera rlhf`` runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tessera
from tessera import comm
from tessera.context import ParallelContext, get_context
from tessera.errors import ConfigError
from tessera.files import write_atomically
from tessera.rlhf.batches import PreferenceDataset, PromptDataset, SFTDataset, build_rollout_batch
from tessera.rlhf.dpo import DPOTrainer
from tessera.rlhf.experience import Frozen, rollout
from tessera.rlhf.grpo import GRPOTrainer
from tessera.rlhf.ppo import PPOTrainer
from tessera.rlhf.reward import RewardTrainer
from tessera.rlhf.rollout import RolloutGenerator
from tessera.rlhf.sft import SFTTrainer
from tessera.rlhf.sorting import sorting_reward
from tessera.rlhf_pipeline.build import Built, StopPenalty, rule_reward
from tessera.rlhf_pipeline.config import (
    SORTING,
    STAGES,
    WEIGHTS,
    DPOStageConfig,
    ExampleData,
    GenerationConfig,
    GRPOStageConfig,
    LoopConfig,
    PPOStageConfig,
    RMStageConfig,
    SFTStageConfig,
    StageConfig,
    default_run_dir,
    load_stage_config,
)
from tessera.rlhf_pipeline.output import SHOWN, RunLog, announce_stage, finish_stage, save_engine
from tessera.rlhf_pipeline.plan import (
    RolePlan,
    chunks,
    data_share,
    index_batches,
    plan_stage,
    preference_examples,
    prompt_examples,
    sft_examples,
)
from tessera.rlhf_pipeline.sections import _plain
from tessera.rlhf_pipeline.tokens import stop_ids, tokenizer_of


def _total_steps(loop: LoopConfig, rows: int) -> int:
    if loop.steps is not None:
        return loop.steps
    per_epoch = rows // loop.batch_size
    if per_epoch == 0:
        raise ConfigError(f"train.batch_size={loop.batch_size} is larger than the {rows} training rows")
    return loop.epochs * per_epoch


def _due(step: int, total: int, every: int | None) -> bool:
    return step == total or (every is not None and step % every == 0)


# ---- SFT, reward model, DPO: one trained model on every rank -------------------------------------


def _eval_batches(dataset: Any, ctx: ParallelContext, loop: LoopConfig) -> list[Any]:
    """This rank's share of the held-out rows (``eval_size`` of them, cut to a multiple of the data
    ranks), in batches of at most ``eval_batch_size``."""
    rows = list(range(min(len(dataset), loop.eval_size or len(dataset))))
    rows = rows[: len(rows) - len(rows) % ctx.size("data")]
    if not rows:
        raise ConfigError(f"the held-out set has fewer rows than the {ctx.size('data')} data ranks")
    mine = data_share(rows, ctx)
    parts = chunks(mine, math.ceil(len(mine) / loop.eval_batch_size))
    return [dataset.collate([dataset[i] for i in part]) for part in parts]


def _supervised(stage: str, cfg: StageConfig, plans: Mapping[str, RolePlan], run_dir: Path,
                make: Callable[[Built], tuple[Any, Any]], train_set: Any, eval_set: Any) -> None:  # fmt: skip
    """The loop of SFT, reward modelling and DPO: ``make(built) -> (trainer, engine)``."""
    loop = cfg.train
    total = _total_steps(loop, len(train_set))
    built = Built(plans)
    trainer, engine = make(built)
    trained = next(iter(plans.values()))
    truncated = getattr(train_set, "truncated", 0)
    announce_stage(stage, plans, f"{len(train_set)} training rows" + (f" ({truncated} cut to data.max_len)" if truncated
              else "") + (f", {len(eval_set)} held out" if eval_set is not None else ""), run_dir, total)  # fmt: skip
    log = RunLog(stage, run_dir, total, loop.log_every, SHOWN[stage])
    held = _eval_batches(eval_set, engine.ctx, loop) if eval_set is not None else None
    if held is not None:
        log.write(0, None, trainer.evaluate(held))
    batches = index_batches(len(train_set), loop.batch_size, loop.shuffle, cfg.seed)
    for step in range(1, total + 1):
        mine = data_share(next(batches), engine.ctx)
        micro = [
            train_set.collate([train_set[i] for i in part]) for part in chunks(mine, engine.micro_batches_per_step)
        ]
        metrics = trainer.train_step(micro)
        evaluation = trainer.evaluate(held) if held is not None and _due(step, total, loop.eval_every) else None
        log.write(step, metrics, evaluation)
    save_engine(engine, trained, run_dir / WEIGHTS)
    finish_stage(stage, cfg, plans, run_dir, log, total)


def _example_sets(cls: Any, load: Callable[[str, str], Any], data: ExampleData, tokenizer: Any) -> tuple[Any, Any]:
    """The training and held-out datasets (``cls``: SFTDataset or PreferenceDataset) of ``data``."""

    def made(given: str, split: str) -> Any:
        return cls(load(given, split), tokenizer, max_len=data.max_len, max_prompt_len=data.max_prompt_len)

    return made(data.train, "train"), made(data.eval, "eval") if data.eval is not None else None


def run_sft(cfg: SFTStageConfig, plans: Mapping[str, RolePlan], run_dir: Path) -> None:
    train_set, eval_set = _example_sets(SFTDataset, sft_examples, cfg.data, tokenizer_of(plans["policy"].spec))

    def make(built: Built) -> tuple[Any, Any]:
        engine = built.engine("policy")
        return SFTTrainer(engine), engine

    _supervised("sft", cfg, plans, run_dir, make, train_set, eval_set)


def run_rm(cfg: RMStageConfig, plans: Mapping[str, RolePlan], run_dir: Path) -> None:
    train_set, eval_set = _example_sets(
        PreferenceDataset, preference_examples, cfg.data, tokenizer_of(plans["reward_model"].spec)
    )

    def make(built: Built) -> tuple[Any, Any]:
        engine = built.engine("reward_model")
        return RewardTrainer(engine, cfg.rm), engine

    _supervised("rm", cfg, plans, run_dir, make, train_set, eval_set)


def run_dpo(cfg: DPOStageConfig, plans: Mapping[str, RolePlan], run_dir: Path) -> None:
    train_set, eval_set = _example_sets(
        PreferenceDataset, preference_examples, cfg.data, tokenizer_of(plans["policy"].spec)
    )

    def make(built: Built) -> tuple[Any, Any]:
        engine = built.engine("policy")
        reference = built.frozen("reference") if "reference" in plans else None
        return DPOTrainer(engine, reference, cfg.dpo), engine

    _supervised("dpo", cfg, plans, run_dir, make, train_set, eval_set)


# ---- PPO and GRPO: models on ranks of their own --------------------------------------------------


class HeldOut:
    """Greedy answers of the actor to held-out prompts, scored by the job's reward; on the sorting
    task with a reward model, also by the task's rule (``score``) and the share of exact answers
    (``solved``)."""

    def __init__(self, trainer: Any, actor: Any, prompts: list[list[int]], generation: GenerationConfig,
                 stops: Sequence[int], tokenizer: Any, texts: list[str], rule_scored: bool, pad_id: int) -> None:  # fmt: skip
        self.trainer, self.prompts, self.texts, self.tokenizer = trainer, prompts, texts, tokenizer
        self.rule_scored, self.pad_id = rule_scored, pad_id
        params = generation.sampling(stops, greedy=True)
        self.generator = RolloutGenerator(actor.module, params, ctx=actor.ctx, stream=0) if actor is not None else None

    def __call__(self) -> dict[str, float]:
        responses = rollout(self.trainer.job, self.generator, self.prompts, seed=0)
        batch = build_rollout_batch(self.prompts, responses, self.pad_id)
        scores = self.trainer.job.scores(batch, self.prompts, responses)
        out = {"reward": float(scores.float().mean()), "response_length": sum(map(len, responses)) / len(responses)}
        if self.texts:  # the sorting task: its rule, whatever the reward is
            rule = [sorting_reward(p, self.tokenizer.decode(r)) for p, r in zip(self.texts, responses)]
            if not self.rule_scored:
                out["score"] = sum(rule) / len(rule)
            out["solved"] = sum(s == 1.0 for s in rule) / len(rule)
        return out


def _rl(stage: str, cfg: PPOStageConfig | GRPOStageConfig, plans: Mapping[str, RolePlan], run_dir: Path) -> None:
    tok = tokenizer_of(plans["actor"].spec)
    d, loop = cfg.data, cfg.train
    stops = stop_ids(cfg.generation, tok)
    train_set = PromptDataset(prompt_examples(d.train, "train"), tok, max_prompt_len=d.max_prompt_len)
    total = _total_steps(loop, len(train_set))
    built = Built(plans)
    actor = built.engine("actor")
    reference = built.frozen("reference") if "reference" in plans else None
    penalty = cfg.reward.missing_stop_penalty
    if cfg.reward.rule is not None:
        reward: Any = rule_reward(sorting_reward, tok, stops, penalty)
    else:
        reward = built.frozen("reward")
        if reward is not None and penalty:
            reward = Frozen(StopPenalty(reward, stops, penalty), reward.ctx)
    params = cfg.generation.sampling(stops)
    if isinstance(cfg, PPOStageConfig):
        critic = built.engine("critic", head_std=0.0)  # a fresh head: values start at 0
        trainer: Any = PPOTrainer(actor, critic, reference, reward, params, cfg.ppo, pad_id=train_set.pad_id)
    else:
        critic = None
        trainer = GRPOTrainer(actor, reference, reward, params, cfg.grpo, pad_id=train_set.pad_id)
    held = None
    if d.eval is not None:
        examples = prompt_examples(d.eval, "eval")[: loop.eval_size]
        whole = math.lcm(*(p.data for p in plans.values()))  # each model's data ranks take equal shares
        examples = examples[: len(examples) - len(examples) % whole]
        if not examples:
            raise ConfigError(f"data.eval: fewer held-out prompts than the {whole} shares they are split into")
        eval_set = PromptDataset(examples, tok, max_prompt_len=d.max_prompt_len)
        texts = eval_set.prompts if d.eval == SORTING else []
        held = HeldOut(trainer, actor, eval_set.items, cfg.generation, stops, tok, texts,
                       cfg.reward.rule is not None, train_set.pad_id)  # fmt: skip
    extra = f"{len(train_set)} training prompts, {cfg.train.batch_size} per step" + (
        f" x {cfg.grpo.group_size} responses" if isinstance(cfg, GRPOStageConfig) else ""
    )
    reward_text = f"reward: rule {cfg.reward.rule!r}" if cfg.reward.rule is not None else ""
    announce_stage(stage, plans, "; ".join(t for t in (extra, reward_text) if t), run_dir, total)
    log = RunLog(stage, run_dir, total, loop.log_every, SHOWN[stage])
    if held is not None:
        log.write(0, None, held())
    batches = index_batches(len(train_set), loop.batch_size, loop.shuffle, cfg.seed)
    for step in range(1, total + 1):
        prompts = [train_set[i] for i in next(batches)]
        metrics = trainer.step(prompts, seed=cfg.seed * 1_000_003 + step)
        log.write(step, metrics, held() if held is not None and _due(step, total, loop.eval_every) else None)
    if actor is not None:
        save_engine(actor, plans["actor"], run_dir / WEIGHTS)
    if critic is not None:
        save_engine(critic, plans["critic"], run_dir / "critic.safetensors")
    finish_stage(stage, cfg, plans, run_dir, log, total)


def run_ppo(cfg: PPOStageConfig, plans: Mapping[str, RolePlan], run_dir: Path) -> None:
    _rl("ppo", cfg, plans, run_dir)


def run_grpo(cfg: GRPOStageConfig, plans: Mapping[str, RolePlan], run_dir: Path) -> None:
    _rl("grpo", cfg, plans, run_dir)


RUNNERS: dict[str, Callable[..., None]] = {
    "sft": run_sft,
    "rm": run_rm,
    "ppo": run_ppo,
    "dpo": run_dpo,
    "grpo": run_grpo,
}


def run_stage(stage: str, cfg: StageConfig, run_dir: Path) -> None:
    """Run ``stage`` on every rank of the launched job (collective) and write its folder."""
    ctx = get_context()
    plans = plan_stage(stage, cfg, ctx.world_size)
    if ctx.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved = {"stage": stage, "world_size": ctx.world_size, **json.loads(json.dumps(dataclasses.asdict(cfg)))}
        if "reward" in resolved and isinstance(resolved["reward"], dict) and "from_" in resolved["reward"]:
            resolved["reward"]["from"] = resolved["reward"].pop("from_")
        write_atomically(run_dir / "config.json", json.dumps(resolved, indent=2) + "\n")
    comm.barrier(ctx.group("world"))
    RUNNERS[stage](cfg, plans, run_dir)


# ---- each rank's entry point ---------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each rank (``python -m tessera.rlhf_pipeline STAGE CONFIG`` under torchrun)."""
    parser = argparse.ArgumentParser(prog="python -m tessera.rlhf_pipeline")
    parser.add_argument("stage", choices=list(STAGES))
    parser.add_argument("config", nargs="?", default=None)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args(argv)
    cfg = load_stage_config(args.stage, args.config, args.set)
    tessera.launch_from_torch({"seed": cfg.seed, "launch": _plain(cfg.launch), "comm": _plain(cfg.comm)})
    ctx = get_context()
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.stage, cfg)
    run_dir = Path(comm.broadcast_object(str(run_dir), ctx.group("world")))  # one folder for all ranks
    try:
        run_stage(args.stage, cfg, run_dir)
    finally:
        tessera.shutdown()
    return 0
