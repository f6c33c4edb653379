"""``tessera bench diffusion``: what the image and video applications of docs/diffusion.md need in
memory.

The UNet rows train the small Stable Diffusion of :mod:`tessera.diffusion` (a diffusers UNet under a
frozen CLIP text encoder and a frozen VAE) on 4 ranks, the same global batches and weights on every
side: plain torch DDP (the anchor, as in Colossal-AI's diffusion experiment), ZeRO-3 and Gemini (its
model state beyond small device and host budgets on disk), each with and without activation
checkpointing. A side's memory is its ranks' largest peak RSS above their resident size before the
model was built (the analogue of ``torch.cuda.max_memory_allocated``: the process and its imports are
outside it). The largest UNet rows grow the width until a side no longer trains within one budget per
rank: plain DDP against the side with the lowest peak. The video rows are
:func:`tessera.bench.video.longest_clip_rows` (docs/video.md).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tessera.bench.diffusion_sides import SIDES, UNetCase, side_body
from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows

if TYPE_CHECKING:
    from tessera.testing import PoolSet

_MIB = 2**20
ANCHOR = "torch DDP"


@dataclass(frozen=True)
class Widest:
    """The largest-UNet search: ``budget`` bytes per rank above the baseline; ``widths`` tried in
    order (multiples of 8) until one does not fit. Gemini is given a share of the budget as its
    device and host budgets (``device_share``, ``host_share``; the rest of its model state on
    disk), as a user sizes it for the memory they have."""

    budget: int = 384 * _MIB
    widths: tuple[int, ...] = (16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384)
    device_share: float = 1 / 3
    host_share: float = 1 / 8

    def case(self, case: UNetCase, width: int) -> UNetCase:
        device, host = int(self.budget * self.device_share), int(self.budget * self.host_share)
        return dataclasses.replace(
            case, width=width, gemini_device=device, gemini_device_whole=device, gemini_host=host
        )


CASE, WIDEST = UNetCase(), Widest()


def run_side(side: str, case: UNetCase, ranks: int = 4, pools: PoolSet | None = None) -> dict[str, Any]:
    """``side`` on ``ranks`` fresh ranks (or ``pools``'): the largest peak of its ranks, rank 0's
    losses and step time, the UNet's parameters; ``peak`` None where it failed or /proc cannot tell."""
    with rank_pool(ranks, pools) as pool:
        try:
            results = pool.run(side_body, side, case, timeout=3600)
        except Exception as error:  # a rank died or raised: this size does not train here
            return {"peak": None, "error": str(error).splitlines()[0] if str(error) else type(error).__name__}
    peaks = [r["peak"] for r in results]
    first = results[0]
    return {**first, "peak": None if any(p is None for p in peaks) else max(peaks)}


def unet_rows(
    case: UNetCase = CASE, sides: tuple[str, ...] = SIDES, ranks: int = 4, pools: PoolSet | None = None
) -> tuple[list[Row], dict[str, dict[str, Any]]]:
    """Rows ``unet <side> vs DDP`` (metrics ``peak_rss_mib`` and ``step_time_s``) of each side
    against plain DDP without checkpointing, and what each side measured."""
    if "ddp" not in sides:
        raise ValueError(f"the UNet rows compare with plain DDP: sides {sides} must include 'ddp'")
    found = {side: run_side(side, case, ranks, pools) for side in sides}
    for side, seen in found.items():
        if seen["peak"] is None:
            raise RuntimeError(f"tessera bench diffusion: the {side} side did not train: {seen.get('error')}")
    ddp = found["ddp"]
    rows: list[Row] = []
    for side in sides:
        if side == "ddp":
            continue
        seen = found[side]
        rows.append(Row(f"unet w{case.width} {side} x{ranks}", "peak_rss_mib", seen["peak"] / _MIB, ANCHOR,
                        ddp["peak"] / _MIB))  # fmt: skip
        rows.append(Row(f"unet w{case.width} {side} x{ranks}", "setup_peak_mib", seen["setup_peak"] / _MIB, ANCHOR,
                        ddp["setup_peak"] / _MIB))  # fmt: skip
        rows.append(Row(f"unet w{case.width} {side} x{ranks}", "step_time_s", seen["step_time"], ANCHOR,
                        ddp["step_time"]))  # fmt: skip
    return rows, found


def lowest(found: dict[str, dict[str, Any]]) -> str:
    """The tessera side with the lowest peak."""
    return min((s for s in found if not s.startswith("ddp")), key=lambda s: found[s]["peak"])


def widest(
    side: str, search: Widest, case: UNetCase, ranks: int = 4, pools: PoolSet | None = None
) -> tuple[int, dict[int, int | None]]:
    """The parameters of the widest UNet ``side`` trains within the budget, and the peak measured
    at each width tried."""
    best, seen = 0, {}
    for width in search.widths:
        got = run_side(side, search.case(case, width), ranks, pools)
        seen[width] = got["peak"]
        if got["peak"] is None or got["peak"] > search.budget:
            break
        best = got["parameters"]
    return best, seen


def widest_rows(
    side: str, search: Widest = WIDEST, case: UNetCase = CASE, ranks: int = 4, pools: PoolSet | None = None
) -> tuple[list[Row], dict[str, Any]]:
    """The row ``largest unet under <budget>``: ``side``'s widest UNet (in parameters) against
    plain DDP's."""
    found = {"ddp": widest("ddp", search, case, ranks, pools), side: widest(side, search, case, ranks, pools)}
    row = Row(f"largest unet {side} under {search.budget // _MIB} MiB/rank x{ranks}", "parameters",
              float(found[side][0]), ANCHOR, float(max(found["ddp"][0], 1)))  # fmt: skip
    return [row], found


def main(args: argparse.Namespace) -> int:
    from tessera.bench.video import longest_clip_rows

    rows, found = unet_rows()
    for side, seen in found.items():
        print(f"  {side:<12} peak {seen['peak'] / _MIB:7.1f} MiB  step {seen['step_time']:.3f} s  losses "
              + " ".join(f"{v:.5f}" for v in seen["losses"]), flush=True)  # fmt: skip
    best = lowest(found)
    more, sizes = widest_rows(best)
    rows += more
    for side, (params, seen) in sizes.items():
        tried = ", ".join(f"w{w}: {'-' if g is None else f'{g / _MIB:.0f}'}" for w, g in seen.items())
        print(f"  largest {side}: {params:,} parameters ({tried} MiB)", flush=True)
    video, _ = longest_clip_rows()
    rows += video
    print_rows(rows)
    if args.out:
        write_rows(rows, args.out)
    return 0


__all__ = ["ANCHOR", "SIDES", "UNetCase", "Widest", "lowest", "main", "run_side", "unet_rows", "widest", "widest_rows"]
