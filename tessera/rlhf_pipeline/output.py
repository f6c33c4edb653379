"""What a ``tessera rlhf`` stage writes and prints: the metrics log (``metrics.jsonl`` and a line
per logged step), the plots' panels, ``summary.json``, the model card and the saved weights (and
a model's LoRA adapters: merged into its weights for the next stage, and alone as a PEFT folder)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tessera import comm
from tessera.checkpoint import full_state_dict, save_weights
from tessera.config.schema import HF_PREFIX
from tessera.context import get_context
from tessera.files import write_atomically
from tessera.hf.adapters import merged_state_dict, save_adapters
from tessera.rlhf.plots import Panel, plot_metrics
from tessera.rlhf_pipeline.config import CARD, WEIGHTS, StageConfig
from tessera.rlhf_pipeline.plan import RolePlan
from tessera.session import current_config, set_session

ADAPTERS = {"model.safetensors": "adapter", "critic.safetensors": "critic_adapter"}  # each file's PEFT folder


class RunLog:
    """The stage's ``metrics.jsonl`` and its printed lines, written by job rank 0; every rank
    keeps the records (the same everywhere)."""

    def __init__(self, stage: str, run_dir: Path, total: int, every: int, shown: Sequence[str]) -> None:
        self.stage, self.total, self.every, self.shown = stage, total, every, tuple(shown)
        self.writer = get_context().rank == 0
        self.path = run_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        self.start = time.perf_counter()
        if self.writer:
            self.path.write_text("")

    def write(self, step: int, metrics: Mapping[str, float] | None, evaluation: Mapping[str, float] | None) -> None:
        due = step % self.every == 0 or step == self.total
        if evaluation is None and (metrics is None or not due):
            return
        record: dict[str, Any] = {"step": step, "time": round(time.perf_counter() - self.start, 3)}
        record.update(metrics or {})
        record.update({f"eval/{k}": v for k, v in (evaluation or {}).items()})
        self.records.append(record)
        if self.writer:
            with self.path.open("a") as out:
                out.write(json.dumps(record) + "\n")
            shown = [f"{k} {record[k]:.4g}" for k in self.shown if k in record]
            shown += [f"{k} {v:.4g}" for k, v in record.items() if k.startswith("eval/")]
            print(
                f"tessera rlhf {self.stage}: step {step}/{self.total}  " + "  ".join(shown), file=sys.stderr, flush=True
            )


PANELS: dict[str, tuple[Panel, ...]] = {
    "sft": (Panel("loss", "SFT: loss on response tokens", "nats per token", (("train", "loss"), ("held-out", "eval/loss"))),),
    "rm": (
        Panel("loss", "Reward model: pairwise loss", "loss", (("train", "loss"), ("held-out", "eval/loss"))),
        Panel("accuracy", "Reward model: pairs ranked right", "accuracy",
              (("train", "accuracy"), ("held-out", "eval/accuracy"))),
        Panel("margin", "Reward model: chosen - rejected score", "margin",
              (("train", "margin"), ("held-out", "eval/margin"))),
    ),
    "dpo": (
        Panel("loss", "DPO: loss", "loss", (("train", "loss"), ("held-out", "eval/loss"))),
        Panel("accuracy", "DPO: pairs ranked right", "accuracy", (("train", "accuracy"), ("held-out", "eval/accuracy"))),
        Panel("margin", "DPO: implicit reward margin", "beta x log-ratio margin",
              (("train", "margin"), ("held-out", "eval/margin"))),
    ),
    "ppo": (
        Panel("reward", "PPO: reward", "reward", (("rollouts (sampled)", "reward"), ("held-out (greedy)", "eval/reward"),
                                                  ("held-out sorting score", "eval/score"))),
        Panel("kl", "PPO: KL to the reference", "summed KL per response", (("KL", "kl"),)),
        Panel("loss", "PPO: losses", "loss", (("policy", "policy/loss"), ("value", "value/loss"))),
    ),
    "grpo": (
        Panel("reward", "GRPO: reward", "reward", (("rollouts (sampled)", "reward"), ("held-out (greedy)", "eval/reward"),
                                                   ("held-out sorting score", "eval/score"))),
        Panel("kl", "GRPO: KL to the reference (k3)", "KL", (("KL", "kl"),)),
        Panel("loss", "GRPO: loss", "loss", (("policy", "loss"),)),
    ),
}  # fmt: skip

SHOWN = {
    "sft": ("loss",),
    "rm": ("loss", "accuracy", "margin"),
    "dpo": ("loss", "accuracy", "margin"),
    "ppo": ("reward", "kl", "policy/loss", "value/loss"),
    "grpo": ("reward", "reward_std", "kl", "loss"),
}


def _means(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    keys = {k for r in records for k, v in r.items() if isinstance(v, int | float) and not k.startswith("eval/")}
    keys -= {"step", "time"}
    return {k: sum(r[k] for r in records if k in r) / sum(k in r for r in records) for k in sorted(keys)}


def summary(stage: str, records: Sequence[Mapping[str, Any]], seconds: float, steps: int) -> dict[str, Any]:
    """The figures of a stage: its first and last evaluation, and its training metrics averaged
    over the first and the last tenth of the logged steps (rollout rewards are noisy)."""
    evals = [{k[5:]: v for k, v in r.items() if k.startswith("eval/")} | {"step": r["step"]}
             for r in records if any(k.startswith("eval/") for k in r)]  # fmt: skip
    trained = [r for r in records if r["step"] > 0]
    tenth = max(1, len(trained) // 10)
    return {
        "stage": stage,
        "steps": steps,
        "seconds": round(seconds, 2),
        "eval_first": evals[0] if evals else None,
        "eval_last": evals[-1] if evals else None,
        "train_first": _means(trained[:tenth]) if trained else None,
        "train_last": _means(trained[-tenth:]) if trained else None,
    }


def save_engine(engine: Any, plan: RolePlan, path: Path) -> None:
    """The engine's full state to ``path`` (collective over the engine's ranks; its rank 0
    writes). With LoRA adapters: the adapters merged into the base (a plain model's weights, which
    the next stage loads as any), and the adapters alone as a PEFT folder beside (:data:`ADAPTERS`)."""
    if plan.lora is None:
        state = full_state_dict(engine)
    else:
        job, job_config = get_context(), current_config()
        set_session(engine.ctx, plan.config)  # the engine's rank 0 writes the folder
        try:
            save_adapters(engine, path.parent / ADAPTERS[path.name], base_model=_spec(plan).hf_path)
        finally:
            set_session(job, job_config)
        state = merged_state_dict(engine)
    if engine.ctx.rank == 0:
        save_weights(state, path)


def _spec(plan: RolePlan) -> Any:
    spec = plan.spec
    if spec.hf_path is not None:  # the next stage may run elsewhere: name the folder whole
        spec = dataclasses.replace(spec, name=HF_PREFIX + str(Path(spec.hf_path).resolve()))
    return spec


def _adapters_card(plans: Mapping[str, RolePlan]) -> dict[str, Any]:
    """What the card says of the stage's adapters: each trained model's (its PEFT folder, the
    base it trained on) and a reference that was the policy's base with its adapters off."""
    card: dict[str, Any] = {}
    for plan in plans.values():
        if plan.lora is not None:
            folder = ADAPTERS["critic.safetensors" if plan.role == "critic" else WEIGHTS]
            base = str(plan.weights.resolve()) if plan.weights is not None else None
            card.setdefault("lora", {})[plan.role] = {**dataclasses.asdict(plan.lora), "adapter": folder, "base": base,
                                                     "merged": True}  # fmt: skip
        if plan.base_of is not None:
            card["reference"] = f"the {plan.base_of}'s frozen base with its LoRA adapters off"
    return card


def finish_stage(stage: str, cfg: StageConfig, plans: Mapping[str, RolePlan], run_dir: Path, log: RunLog,
                 steps: int) -> None:  # fmt: skip
    """model.json, the plots and summary.json (job rank 0), once the weights are written; the
    card's model is the stage's first (the trained one). Collective: every rank returns once the
    folder is whole (a next stage of the same job reads its model.json)."""
    world = get_context().group("world")
    comm.barrier(world)  # the weights are on disk before the stage reports done
    if get_context().rank == 0:
        _write_card_and_figures(stage, plans, run_dir, log, steps)
    comm.barrier(world)


def _write_card_and_figures(stage: str, plans: Mapping[str, RolePlan], run_dir: Path, log: RunLog, steps: int) -> None:
    plan = next(iter(plans.values()))
    card: dict[str, Any] = {
        "stage": stage,
        "value": plan.value,
        "model": dataclasses.asdict(_spec(plan)),
        "weights": WEIGHTS,
    }
    card |= _adapters_card(plans)
    write_atomically(run_dir / CARD, json.dumps(card, indent=2) + "\n")
    plots = plot_metrics(log.records, PANELS[stage], run_dir)
    figures = summary(stage, log.records, time.perf_counter() - log.start, steps)
    write_atomically(run_dir / "summary.json", json.dumps(figures, indent=2) + "\n")
    folders = [f"{a['adapter']}/" for a in card.get("lora", {}).values()]
    names = ", ".join([WEIGHTS, *folders, *(p.name for p in plots)])
    print(f"tessera rlhf {stage}: done in {figures['seconds']:.1f} s; wrote {run_dir} ({names})",
          file=sys.stderr, flush=True)  # fmt: skip


def announce_stage(stage: str, plans: Mapping[str, RolePlan], extra: str, run_dir: Path, steps: int) -> None:
    if get_context().rank != 0:
        return
    print(f"tessera rlhf {stage}: {steps} steps on {get_context().world_size} rank(s); run folder {run_dir}",
          file=sys.stderr)  # fmt: skip
    for plan in plans.values():
        print(f"  {plan.describe()}  [{plan.spec.describe()}]", file=sys.stderr)
    if extra:
        print(f"  {extra}", file=sys.stderr, flush=True)
