"""The RLHF pipeline behind ``tessera rlhf STAGE CONFIG``: supervised fine-tuning (``sft``), a
reward model (``rm``), then PPO, DPO or GRPO, each stage a run of its own configured from a file.

**Stages and their models.** Each stage trains one model and writes it to its folder, where the
next stage reads it (``init``, or the reward's ``from``):

========  =======================================================  ====================================
stage     models (config sections)                                 writes ``model.safetensors`` of
========  =======================================================  ====================================
``sft``   ``policy``                                               the policy (a causal LM)
``rm``    ``reward_model`` (a value model, its backbone from SFT)  the reward model
``dpo``   ``policy``, ``reference`` (the policy's start, frozen)   the policy
``ppo``   ``actor``, ``critic``, ``reference``, ``reward``         the actor (and ``critic.safetensors``)
``grpo``  ``actor``, ``reference``, ``reward``                     the actor
========  =======================================================  ====================================

A model's architecture is the top-level ``model`` section (tessera's GPT preset with overrides,
or ``hf:PATH``), or that of the stage folder it starts from: every stage writes ``model.json``
(the architecture and whether it is a causal LM or a value model) beside its weights. Weights
that hold a value head (``score.*``) load whole into a value model; a causal LM's load into its
backbone (:meth:`~tessera.rlhf.models.ValueModel.load_backbone`): a reward model or critic from
the SFT model.

**Layouts.** Each model has the usual sections of a tessera config (``parallel``, ``zero``,
``mixed_precision``, ``activation_checkpoint``, ``gradient_accumulation``, ``clip_grad_norm``)
and, in PPO and GRPO, ``ranks``: the ranks of the job that hold it (default: every rank), under
a context of their own (:meth:`ParallelContext.on_ranks
<tessera.context.ParallelContext.on_ranks>`). Frozen models (the reference, a reward model)
take ``ranks`` and ``parallel`` only. Everything is checked before any process starts
(:func:`plan_stage`): unknown keys, ranks outside the job, layouts that do not fit their ranks,
batches that do not split over data ranks and accumulation, missing weights.

**LoRA adapters.** Each trained model takes a ``lora`` section (tessera's ``LoraConfig``): it then
trains adapters on its frozen weights, and a policy's or actor's reference is its own base with
the adapters off (:class:`~tessera.rlhf.adapters.AdaptersOff`), no model of its own. A stage
writes its adapters as a PEFT folder and its weights with them merged (what the next stage
loads).

**A stage's folder**: ``config.json`` (the resolved config), ``metrics.jsonl`` (a line every
``train.log_every`` steps and at every evaluation: the step's metrics, ``eval/...`` the held-out
ones, ``time`` the seconds since training began), ``model.safetensors`` and ``model.json``,
``summary.json`` (first and last figures, wall time) and SVG plots of the metrics
(:mod:`tessera.rlhf.plots`).

Every rank runs :func:`main` (``tessera rlhf`` starts them through torchrun).
"""

from tessera.rlhf_pipeline.config import (
    STAGES,
    DPOStageConfig,
    GRPOStageConfig,
    PPOStageConfig,
    RMStageConfig,
    SFTStageConfig,
    default_run_dir,
    load_stage_config,
)
from tessera.rlhf_pipeline.plan import RolePlan, plan_stage
from tessera.rlhf_pipeline.reference import config_reference
from tessera.rlhf_pipeline.run import main, run_stage

__all__ = [
    "STAGES",
    "DPOStageConfig",
    "GRPOStageConfig",
    "PPOStageConfig",
    "RMStageConfig",
    "RolePlan",
    "SFTStageConfig",
    "config_reference",
    "default_run_dir",
    "load_stage_config",
    "main",
    "plan_stage",
    "run_stage",
]
