"""What each ZeRO stage shards, as a policy of the one sharded optimizer, and the options the
top layer builds from the config's ``zero`` section."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import ConfigError


@dataclass(frozen=True)
class ZeroPolicy:
    """When gradients are reduced and whether parameters are released between uses.

    - ``reduce_in_backward``: each chunk's gradients are reduce-scattered as soon as the
      backward pass completes them, and only this rank's shard is kept (stages 2 and 3);
      otherwise full gradients stay until the step and are reduce-scattered then (stage 1).
    - ``release_parameters``: a chunk's full parameters exist only while a module that uses
      them runs (stage 3); otherwise every rank keeps them (stages 1 and 2).
    """

    stage: int
    reduce_in_backward: bool
    release_parameters: bool

    @classmethod
    def for_stage(cls, stage: int) -> ZeroPolicy:
        """The policy of ZeRO stage 1, 2 or 3."""
        if stage not in (1, 2, 3):
            raise ConfigError(f"zero.stage={stage} is not a ZeRO stage of the sharded optimizer; allowed: 1, 2, 3")
        return cls(stage, reduce_in_backward=stage >= 2, release_parameters=stage == 3)


@dataclass(frozen=True)
class ZeroOptions:
    """The sharded optimizer's settings: the stage's policy, the parameters' dtype
    (``"fp32"``, ``"bf16"``, ``"fp16"``), the chunk capacity in MiB (a chunk is also the unit
    of a gradient reduction), whether gradient reductions overlap the backward pass, where
    fp32 masters and optimizer states live (``"none"``: the device; ``"cpu"``: host memory), and
    which replicas share the shards (``"all"``; ``"host"``: those of each host, the shards repeated
    on every host: ``tessera.zero.hybrid``)."""

    policy: ZeroPolicy
    precision: str = "fp32"
    chunk_mb: float = 25.0
    overlap_comm: bool = True
    offload: str = "none"
    shard: str = "all"
