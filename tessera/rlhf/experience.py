"""What PPO and GRPO share: the models of a job and where they live, the exchange of rollouts and
per-token results between them, and the per-token tensors of a rollout batch aligned to
response tokens.

**Roles.** An RL job holds up to four models: the actor (an engine; it also generates), the
critic (an engine over a value model), the frozen reference and the reward model (a
:class:`Frozen` model, or for the reward a rule of its own, :data:`RewardFn`). Each lives on the
ranks whose process holds it: every rank of the job may hold every model (co-located), or each
model its own ranks under a context over them
(:meth:`ParallelContext.on_ranks <tessera.context.ParallelContext.on_ranks>`), for example the
actor with ZeRO-2 on ranks 0-1 and the critic with tensor parallelism on ranks 2-3. A rank
passes None for a model it does not hold. :class:`Job` finds out, with one collective at
construction, which ranks hold which model.

**Exchange.** Every per-row quantity (a log-prob per token, a value, a score) is computed by the
ranks of the model it needs, each data rank its contiguous share of the rows; the shares are
gathered over the model's data ranks, then broadcast from the model's first rank to every rank
of the job. Every rank thus ends with the whole experience batch and computes rewards and
advantages itself, identically: they do not depend on the layout. Training then gives each data
rank of the actor and of the critic its contiguous share of the rows.

**Alignment.** A :class:`~tessera.rlhf.batches.SequenceBatch` holds whole sequences: its label
columns carry prompt tokens, then the response, then padding, and prompts differ in length. The
losses and advantages of :mod:`tessera.rlhf.losses` take response tokens only, right-padded
(column ``k`` = response token ``k``). :func:`response_index` gives the label column of each
response token, and :func:`to_responses` gathers per-label tensors into that layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm
from tessera.comm import AxisGroup
from tessera.comm.group import single_rank_group
from tessera.context import ParallelContext
from tessera.rlhf import steps
from tessera.rlhf.batches import SequenceBatch
from tessera.rlhf.dpo import logits_of
from tessera.rlhf.models import sequence_values, token_logprobs_fn
from tessera.rlhf.protocols import HeldModel, TrainedModel
from tessera.rlhf.rollout import RolloutGenerator
from tessera.rlhf.tokens import LogprobsFn

__all__ = [
    "ROLES",
    "Experience",
    "actor_generator",
    "update",
    "engine_micro_batches",
    "minibatches",
    "rollout",
    "Frozen",
    "Job",
    "RewardFn",
    "response_index",
    "row_share",
    "text_reward",
    "to_responses",
]

ROLES = ("actor", "critic", "reference", "reward")

RewardFn = Callable[[Sequence[int], Sequence[int]], float]
"""A rule that scores a response: ``fn(prompt_ids, response_ids) -> float``. Every rank of the job
computes it for every row (it must be deterministic); :func:`text_reward` adapts a rule on text."""


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


def text_reward(rule: Callable[[str, str], float], tokenizer: Decoder) -> RewardFn:
    """A :data:`RewardFn` from a rule on text (``sorting_reward(prompt, response)``, say): the ids
    are decoded with ``tokenizer`` first."""

    def score(prompt: Sequence[int], response: Sequence[int]) -> float:
        return float(rule(tokenizer.decode(list(prompt)), tokenizer.decode(list(response))))

    return score


class Frozen:
    """A model the job only reads (the reference, a reward model), without gradients and in eval
    mode. ``model`` is a module of this rank alone (``ctx`` None: this rank then computes every
    row itself, unless ``ctx`` says how the module is spread), or an engine
    (``tessera.initialize``'s, any layout: ZeRO-3's pieces and tensor-parallel blocks are run
    through its forward; its optimizer never steps), whose context it takes. Its data ranks
    split the rows between them."""

    def __init__(self, model: nn.Module | TrainedModel, ctx: ParallelContext | None = None) -> None:
        self.model = model
        if isinstance(model, nn.Module):
            model.eval().requires_grad_(False)
            if ctx is None:
                device = next((p.device for p in model.parameters()), torch.device("cpu"))
                ctx = ParallelContext.alone(device)
        elif isinstance(model, TrainedModel):  # an engine
            model.eval()
            ctx = ctx if ctx is not None else model.ctx
        else:
            raise TypeError(f"Frozen takes a torch module or a tessera engine, got {type(model).__name__}")
        self.ctx: ParallelContext = ctx

    @property
    def module(self) -> nn.Module:
        """The user's model (an engine's ``module``)."""
        return self.model if isinstance(self.model, nn.Module) else self.model.module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


def row_share(rows: int, ctx: ParallelContext, what: str) -> slice:
    """The contiguous rows of ``rows`` this rank's data index takes (tensor and pipeline ranks of
    one data index take the same rows). ``rows`` must divide evenly."""
    parts, index = ctx.size("data"), ctx.local_rank("data")
    if rows % parts:
        raise ValueError(f"{what}: {rows} rows do not split over {parts} data ranks; give a multiple of {parts}")
    each = rows // parts
    return slice(index * each, (index + 1) * each)


def response_index(batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [B, R], mask [B, R])``: ``index[b, k]`` is the label column of response token ``k``
    of row ``b`` (``R`` the longest response) and ``mask[b, k]`` whether row ``b`` has it.
    Columns past a row's response point at its last response token (masked)."""
    response = batch["response_mask"]
    lengths = response.sum(dim=1)
    if bool((lengths == 0).any()):
        raise ValueError("response_index: a row without response tokens")
    first = response.float().argmax(dim=1)  # the first true column of each row
    width = int(lengths.max())
    k = torch.arange(width, device=response.device)
    mask = k.unsqueeze(0) < lengths.unsqueeze(1)
    index = first.unsqueeze(1) + torch.minimum(k.unsqueeze(0), (lengths - 1).unsqueeze(1))
    return index, mask


def to_responses(per_label: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A per-label-column tensor ``[B, T-1]`` -> response-aligned ``[B, R]`` (see :func:`response_index`)."""
    return per_label.gather(1, index)


Experience = dict[str, torch.Tensor]
"""A rollout batch with everything an update reads, the same on every rank: the
:class:`~tessera.rlhf.batches.SequenceBatch` fields, ``index``/``mask`` ``[B, R]`` (each response
token's label column; real tokens), and response-aligned ``[B, R]`` ``logprobs`` (the actor's
when it generated), ``ref_logprobs``, ``values``, ``kl``, ``rewards``, ``advantages``,
``returns``, and ``scores [B]``."""


def minibatches(rows: int, count: int) -> Iterator[slice]:
    """``count`` contiguous slices of ``rows`` rows (which must divide evenly)."""
    if rows % count:
        raise ValueError(f"{rows} rows do not split into {count} minibatches")
    each = rows // count
    for m in range(count):
        yield slice(m * each, (m + 1) * each)


def engine_micro_batches(experience: Experience, rows: slice, engine: TrainedModel, role: str) -> list[Experience]:
    """This rank's data share of ``rows`` of ``experience``, cut into the engine's micro-batches
    (contiguous), each trimmed to its longest sequence and response."""
    count = rows.stop - rows.start
    mine = row_share(count, engine.ctx, role)
    start = rows.start + mine.start
    parts = engine.micro_batches_per_step
    each = mine.stop - mine.start
    if each % parts:
        raise ValueError(
            f"{role}: {each} rows per data rank do not split into the engine's {parts} micro-batches; "
            "make the rollout batch a multiple of minibatches x data ranks x gradient accumulation"
        )
    size = each // parts
    return [_trim(_rows(experience, slice(start + i * size, start + (i + 1) * size))) for i in range(parts)]


def _rows(experience: Experience, rows: slice) -> Experience:
    return {key: value[rows] for key, value in experience.items()}


def _trim(part: Experience) -> Experience:
    """Drop padding columns no row of ``part`` uses (whole sequences and response columns)."""
    width = int(part["attention_mask"].sum(dim=1).max())
    longest = int(part["mask"].sum(dim=1).max())
    out = dict(part)
    for key in ("input_ids", "attention_mask"):
        out[key] = part[key][:, :width]
    for key in ("labels", "response_mask"):
        out[key] = part[key][:, : width - 1]
    for key, value in part.items():
        if value.dim() == 2 and key not in ("input_ids", "attention_mask", "labels", "response_mask"):
            out[key] = value[:, :longest]
    return out


def update(
    job: Job,
    experience: Experience,
    epochs: int,
    count: int,
    trained: Mapping[str, tuple[TrainedModel | None, steps.LossesFn[Experience], Sequence[str]]],
) -> dict[str, dict[str, float]]:
    """``epochs`` passes over ``experience`` in ``count`` contiguous minibatches, each one optimizer
    step of every model in ``trained`` (role -> ``(engine or None on ranks without it, losses,
    statistics kept)``), in that order, each engine taking its data share of the minibatch in its
    accumulation's micro-batches. Returns each role's loss and statistics averaged over the
    steps, on every rank of the job."""
    rows = experience["input_ids"].shape[0]
    sums: dict[str, dict[str, float]] = {role: {} for role in trained}
    taken = 0
    for _ in range(epochs):
        for part in minibatches(rows, count):
            for role, (engine, losses, _) in trained.items():
                if engine is not None:
                    for key, value in steps.train_step(
                        engine, engine_micro_batches(experience, part, engine, role), losses
                    ).items():
                        sums[role][key] = sums[role].get(key, 0.0) + value
            taken += 1
    shared = {}
    for role, (engine, _, keys) in trained.items():
        mine = {key: sums[role][key] / taken for key in keys} if engine is not None else None
        shared[role] = job.share_floats(role, mine, keys)
    return shared


def actor_generator(actor: HeldModel | None, params: Any, options: Mapping[str, Any] | None) -> RolloutGenerator | None:
    """The rollout generator of ``actor`` (an engine; None on ranks without it) sampling with
    ``params``, ``options`` its KV-cache sizes. Stream 0: requests are seeded by their row's
    number in the whole batch (:func:`rollout`), so any split over data ranks samples alike."""
    if actor is None:
        return None
    return RolloutGenerator(actor.module, params, ctx=actor.ctx, stream=0, **dict(options or {}))


def rollout(
    job: Job, generator: RolloutGenerator | None, prompts: Sequence[Sequence[int]], seed: int
) -> list[list[int]]:
    """Responses to ``prompts`` (every rank the same list), generated by the actor's data ranks,
    each its contiguous share with ``generator`` (None on ranks without the actor), and shared
    with every rank of ``job``. Each ends with its stop token when it stopped on one."""

    def generate(share: slice) -> list[list[int]]:
        assert generator is not None
        return [list(r.response) for r in generator.generate(prompts[share], seed=seed, offset=share.start)]

    responses = job.share_ids("actor", len(prompts), generate)
    empty = [i for i, response in enumerate(responses) if not response]
    if empty:
        raise ValueError(
            f"prompts {empty}: the actor generated nothing (max_tokens=0, or the prompt fills the model's length)"
        )
    return responses


RoleModel = HeldModel | RewardFn | None
"""What a rank holds of a role: an engine or a :class:`Frozen` model, a reward rule, or nothing."""


def _as_model(model: nn.Module | RoleModel) -> RoleModel:
    """A plain module becomes a :class:`Frozen` one of this rank alone; engines, frozen models,
    rules and None stay as they are."""
    if isinstance(model, nn.Module):
        return Frozen(model)
    return model


def _job_group() -> AxisGroup:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return single_rank_group("job")
    return AxisGroup("job", tuple(range(dist.get_world_size())), dist.get_rank(), dist.group.WORLD)


class Job:
    """The models of an RL job and the ranks that hold them (module docstring). Building it is
    collective over every rank of the job, each passing the models it holds (None for others);
    ``models`` maps a role in :data:`ROLES` to an engine, a :class:`Frozen` model, a reward rule
    (held by every rank) or None."""

    def __init__(self, models: Mapping[str, nn.Module | RoleModel]) -> None:
        unknown = set(models) - set(ROLES)
        if unknown:
            raise ValueError(f"Job: unknown roles {sorted(unknown)}; roles are {list(ROLES)}")
        self.group = _job_group()
        self.models: dict[str, RoleModel] = {role: _as_model(models.get(role)) for role in ROLES}
        held = torch.tensor([[self.models[r] is not None for r in ROLES]], dtype=torch.int64)
        table = comm.all_gather(held, self.group)  # [ranks, roles]: who holds what
        self.holders: dict[str, tuple[int, ...]] = {
            role: tuple(int(i) for i in torch.nonzero(table[:, j]).flatten()) for j, role in enumerate(ROLES)
        }
        here = [m for m in map(self.held_model, ROLES) if m is not None]
        self.device = here[0].ctx.device if here else torch.device("cpu")
        # how each language model held here takes token log-probs (vocabulary-parallel or not)
        self.token_logprobs: dict[str, LogprobsFn] = {
            role: token_logprobs_fn(model.module)
            for role in ("actor", "reference")
            if (model := self.held_model(role)) is not None
        }

    def held_model(self, role: str) -> HeldModel | None:
        """The model this rank holds for ``role`` (an engine or a :class:`Frozen` model); None
        when it holds none or the role is a rule."""
        model = self.models[role]
        return model if isinstance(model, HeldModel) else None

    def held(self, role: str) -> bool:
        """Whether any rank of the job holds ``role``."""
        return bool(self.holders[role])

    def require(self, role: str, what: str) -> None:
        if not self.held(role):
            raise ValueError(f"{what}: no rank of the job holds the {role}; pass it on the ranks that hold it")

    def ctx_of(self, role: str) -> ParallelContext:
        model = self.held_model(role)
        if model is None:
            raise RuntimeError(f"this rank does not hold the {role} as a model")
        return model.ctx

    # ---- exchange ---------------------------------------------------------------------------
    def _publish(
        self, role: str, value: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """``value`` (whole, on every rank holding ``role``) broadcast to the ranks that do not."""
        holders = self.holders[role]
        if len(holders) == self.group.size:
            assert value is not None
            return value
        if value is None:
            value = torch.empty(shape, dtype=dtype, device=self.device)
        return comm.broadcast(value.to(self.device).contiguous(), self.group, src=self.group.ranks.index(holders[0]))

    def compute_rows(
        self,
        role: str,
        rows: int,
        fn: Callable[[slice], torch.Tensor],
        tail: tuple[int, ...] = (),
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """``fn(rows this rank takes) -> [n, *tail]`` run by the ranks holding ``role``, each data
        rank its share; the whole ``[rows, *tail]`` returned on every rank of the job."""
        self.require(role, "compute_rows")
        value = None
        if self.models[role] is not None:
            ctx = self.ctx_of(role)
            part = fn(row_share(rows, ctx, role)).to(ctx.device, dtype)
            value = comm.all_gather(part.contiguous(), ctx.group("data"))
        return self._publish(role, value, (rows, *tail), dtype)

    def share_ids(self, role: str, rows: int, fn: Callable[[slice], list[list[int]]]) -> list[list[int]]:
        """Like :meth:`compute_rows` for rows of token ids of any lengths (generated responses)."""
        self.require(role, "share_ids")
        packed, width = None, torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.models[role] is not None:
            ctx = self.ctx_of(role)
            mine = fn(row_share(rows, ctx, role))
            width = torch.tensor([max((len(r) for r in mine), default=0)], device=ctx.device)
            comm.all_reduce(width, ctx.group("data"), op="max")
            part = torch.full((len(mine), int(width) + 1), -1, dtype=torch.int64, device=ctx.device)
            for i, row in enumerate(mine):
                part[i, 0] = len(row)
                part[i, 1 : len(row) + 1] = torch.tensor(row, dtype=torch.int64)
            packed = comm.all_gather(part, ctx.group("data"))
        width = self._publish(role, width, (1,), torch.int64)
        packed = self._publish(role, packed, (rows, int(width) + 1), torch.int64)
        return [row[1 : int(row[0]) + 1].tolist() for row in packed.cpu()]

    def share_floats(self, role: str, values: Mapping[str, float] | None, keys: Sequence[str]) -> dict[str, float]:
        """Scalars known on the ranks holding ``role`` (``values``, the same there) on every rank."""
        self.require(role, "share_floats")
        tensor = None
        if values is not None:
            tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        tensor = self._publish(role, tensor, (len(keys),), torch.float64)
        return {k: float(v) for k, v in zip(keys, tensor.tolist())}

    # ---- what the models compute --------------------------------------------------------------
    def logprobs(self, role: str, batch: SequenceBatch) -> torch.Tensor:
        """Label log-probs ``[B, T-1]`` of ``batch`` under the actor or the reference, in eval mode
        without gradients."""
        model = self.held_model(role)
        rows, width = batch["labels"].shape

        def fn(share: slice) -> torch.Tensor:
            assert model is not None
            with _evaluating(model), torch.no_grad():
                ids = batch["input_ids"][share].to(model.ctx.device)
                logits = logits_of(model(ids))
                return self.token_logprobs[role](logits[:, :-1], batch["labels"][share].to(model.ctx.device))

        return self.compute_rows(role, rows, fn, (width,))

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """The critic's values ``[B, T-1]``: column ``j`` is the value of the state before label
        ``j`` (read at input position ``j``)."""
        model = self.held_model("critic")
        rows, width = batch["labels"].shape

        def fn(share: slice) -> torch.Tensor:
            assert model is not None
            with _evaluating(model), torch.no_grad():
                values = model(batch["input_ids"][share].to(model.ctx.device))
            return values[:, :-1]

        return self.compute_rows("critic", rows, fn, (width,))

    def scores(
        self, batch: SequenceBatch, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """The reward of each row ``[B]``: the rule's, or the reward model's value at the row's
        last real token."""
        rule = self.models["reward"]
        if rule is not None and not isinstance(rule, HeldModel):  # every rank scores every row
            return torch.tensor([rule(p, r) for p, r in zip(prompts, responses)], dtype=torch.float32)
        reward = self.held_model("reward")
        rows = batch["input_ids"].shape[0]

        def fn(share: slice) -> torch.Tensor:
            assert reward is not None
            device = reward.ctx.device
            with _evaluating(reward), torch.no_grad():
                values = reward(batch["input_ids"][share].to(device), batch["attention_mask"][share].to(device))
            return sequence_values(values, batch["last_index"][share].to(device))

        return self.compute_rows("reward", rows, fn)


class _evaluating:
    """Eval mode for an engine, train mode back after (a frozen model stays in eval mode)."""

    def __init__(self, model: HeldModel) -> None:
        self.model = model

    def __enter__(self) -> None:
        if isinstance(self.model, TrainedModel):
            self.model.eval()

    def __exit__(self, *exc: object) -> None:
        if isinstance(self.model, TrainedModel):
            self.model.train()
