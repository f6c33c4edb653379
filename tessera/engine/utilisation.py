"""The trainer's model FLOP utilisation: FLOPs per token, achieved model FLOP/s per rank and MFU
in each step's metrics (:mod:`tessera.engine.flops`, :mod:`tessera.engine.peak`)."""

from __future__ import annotations

from tessera import comm
from tessera.context import ParallelContext
from tessera.engine.flops import achieved_flops_per_rank, mfu
from tessera.engine.hooks import Hook, TrainingLoop
from tessera.engine.peak import DevicePeak, device_peak


def shared_peak(ctx: ParallelContext, dtype: str) -> DevicePeak:
    """One rank's peak for every rank of ``ctx``: rank 0 finds it for its device in ``dtype``
    (:func:`~tessera.engine.peak.device_peak`), the others wait and receive it (collective). A
    measurement runs while the other ranks wait, so on a CPU it has the cores it shares with
    them to itself, at the rank's own intra-op threads."""
    found = device_peak(ctx.device, dtype) if ctx.rank == 0 else None
    peak = comm.broadcast_object(found, ctx.group("world"))
    assert isinstance(peak, DevicePeak)
    return peak


class UtilisationHook(Hook):
    """Adds ``flops_per_token`` (the model's training FLOPs per token: ``GPT.flops_per_token``
    or :func:`tessera.engine.flops.flops_per_token`), ``tflops_per_rank`` (model TFLOP/s one
    rank achieves: the global batch's ``tokens_per_s`` times the FLOPs per token over the world
    size) and ``mfu`` (that over one rank's peak, 0-1) after each step. Reads ``tokens_per_s``
    from :class:`~tessera.engine.ThroughputHook` (given ``tokens_per_sample``), which runs before.

    ``peak``: one rank's peak FLOP/s; default: found at ``before_fit`` by rank 0 for its device
    and the engine's precision (:func:`tessera.engine.peak.device_peak`: the data sheet, the
    cache or a measurement of a second or so) and sent to every rank (collective), so all ranks
    report the same numbers (:func:`shared_peak`)."""

    priority = 25  # after ThroughputHook (20), before the logging hooks

    def __init__(self, flops_per_token: float, peak: DevicePeak | None = None) -> None:
        if flops_per_token <= 0:
            raise ValueError(f"UtilisationHook: flops_per_token={flops_per_token} must be positive")
        self.flops_per_token = flops_per_token
        self.peak = peak

    def before_fit(self, trainer: TrainingLoop) -> None:
        if self.peak is None:
            self.peak = shared_peak(trainer.engine.ctx, trainer.engine.precision)

    def after_step(self, trainer: TrainingLoop) -> None:
        tokens_per_s = trainer.metrics.get("tokens_per_s")
        if tokens_per_s is None or self.peak is None:
            return
        world = trainer.engine.ctx.world_size
        trainer.metrics["flops_per_token"] = self.flops_per_token
        trainer.metrics["tflops_per_rank"] = achieved_flops_per_rank(tokens_per_s, self.flops_per_token, world) / 1e12
        trainer.metrics["mfu"] = mfu(tokens_per_s, self.flops_per_token, world, self.peak.flops_per_s)
