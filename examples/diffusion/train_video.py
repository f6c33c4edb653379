"""Train tessera's video diffusion transformer (an Open-Sora-like ST-DiT) with rectified flow on
synthetic moving-shape clips, its frames split over the sequence axis, and sample clips at the
end into the run folder (docs/video.md).

    torchrun --nproc-per-node 4 examples/diffusion/train_video.py --sequence 2 --data 2 --zero 2 --mode all_to_all
    torchrun --nproc-per-node 4 examples/diffusion/train_video.py --sequence 4 --mode ring --out runs/video-ring
    python examples/diffusion/train_video.py                  # one process

Writes ``samples.png`` (a row per caption, a column per frame), ``samples.gif`` and
``losses.json`` (the loss of each step) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import tessera
from tessera.files import write_atomically
from tessera.models.video import MovingShapes, VideoDiT, VideoDiTConfig, sample, write_frame_strip, write_gif

CAPTIONS = [
    "red square moving right",
    "blue circle moving down",
    "green square moving up",
    "yellow circle moving left",
]


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequence", type=int, default=1, help="ranks of the sequence axis (the frames split)")
    parser.add_argument("--mode", default="ring", choices=["ring", "ring_qk", "all_to_all"])
    parser.add_argument("--data", type=int, default=None, help="data-parallel ranks (default: the rest of the world)")
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2], help="ZeRO stage")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16, help="global batch (clips a step)")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--size", type=int, default=8, help="frame height and width (pixels stand for latents)")
    parser.add_argument("--width", type=int, default=64, help="the model's width")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sample-steps", type=int, default=16, help="Euler steps of the flow when sampling")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/video")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    config = {
        "parallel": {"data": args.data, "sequence": {"size": args.sequence, "mode": args.mode}},
        "zero": {"stage": args.zero},
        "seed": args.seed,
    }
    ctx = tessera.launch_from_torch(config)
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every layout
    model = VideoDiT(VideoDiTConfig(height=args.size, width=args.size, d_model=args.width, n_layers=args.blocks))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = MovingShapes(args.steps * args.batch, frames=args.frames, size=args.size, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch // ctx.size("data"))
    engine, loader, _, _ = tessera.initialize(model, optimizer, None, loader)  # the model returns its loss
    engine.train()
    losses = []
    it = iter(loader)
    for step in range(args.steps):
        losses.append(engine.train_batch(it))
        if ctx.rank == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    engine.eval()
    clips = sample(engine.module, CAPTIONS, args.frames, args.sample_steps, seed=args.seed)  # every rank: its frames
    if ctx.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_frame_strip(clips, out / "samples.png")
        write_gif(clips, out / "samples.gif")
        write_atomically(out / "losses.json", json.dumps({"captions": CAPTIONS, "losses": losses}) + "\n")
        print(f"wrote {out / 'samples.png'}, {out / 'samples.gif'} and {out / 'losses.json'}")
    tessera.shutdown()


if __name__ == "__main__":
    main()
