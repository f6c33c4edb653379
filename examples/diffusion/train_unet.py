"""Train a small Stable Diffusion UNet (diffusers) on captioned coloured shapes under any
tessera layout, then sample one image per caption and save a diffusers folder (docs/diffusion.md).

    python examples/diffusion/train_unet.py --steps 300 --run-dir runs/diffusion
    torchrun --nproc-per-node 2 examples/diffusion/train_unet.py examples/diffusion/gemini.py --checkpoint-blocks

The run folder gets ``metrics.jsonl`` (the loss of each step), ``loss.png``, ``samples-0.png``
(before training) and ``samples-<step>.png`` (every ``--sample-every`` steps and at the end),
``samples.jsonl`` (at each grid: the share of ``--copies`` samples per caption whose named region
is nearest the caption's colour, and the mean colour error there), and ``diffusers/`` (``unet/``,
``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``), which plain diffusers and
transformers load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import tessera
from tessera.diffusion import (
    NoisePrediction,
    ShapesDataset,
    build_parts,
    caption_agreement,
    checkpoint_unet_blocks,
    colour_error,
    fit_text_encoder,
    fit_vae,
    local_batch,
    sample,
    save_folder,
    save_grid,
    trained_parts,
)
from tessera.diffusion.data import caption_text, captions
from tessera.diffusion.objective import TARGETS


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=None, help="a tessera config file (default: data parallel)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16, help="the global batch (split over the data replicas)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--width", type=int, default=16, help="the UNet's first block's channels")
    parser.add_argument("--vae-steps", type=int, default=150, help="steps of the frozen VAE's pretraining")
    parser.add_argument("--text-steps", type=int, default=100, help="steps of the frozen text encoder's pretraining")
    parser.add_argument(
        "--prediction", default="v_prediction", choices=TARGETS, help="what the UNet predicts (the scheduler's)"
    )
    parser.add_argument("--checkpoint-blocks", action="store_true", help="recompute the UNet blocks' activations")
    parser.add_argument("--sample-every", type=int, default=0, help="also sample every this many steps (0: at the end)")
    parser.add_argument("--sampling-steps", type=int, default=25)
    parser.add_argument("--guidance", type=float, default=3.0, help="classifier-free guidance of the samples")
    parser.add_argument("--copies", type=int, default=4, help="samples per caption for the agreement (samples.jsonl)")
    parser.add_argument("--uncaptioned", type=float, default=0.1, help="share of samples trained on the empty caption")
    parser.add_argument("--run-dir", default="runs/diffusion")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def write_samples(engine, parts, run_dir: Path, step: int, args: argparse.Namespace, rank: int) -> None:
    """The grid of one sample per caption, and how many of ``--copies`` samples per caption
    follow their caption's colour in the region it names (``samples.jsonl``)."""
    plain = trained_parts(engine, parts)  # collective
    if rank == 0:
        shown = captions() * args.copies
        texts = [caption_text(*c) for c in shown]
        images = sample(plain, texts, steps=args.sampling_steps, guidance=args.guidance, seed=args.seed)
        save_grid(images[: len(captions())], texts[: len(captions())], run_dir / f"samples-{step}.png")
        scores = {
            "step": step,
            "agreement": caption_agreement(images, shown),
            "colour_error": colour_error(images, shown),
        }
        with open(run_dir / "samples.jsonl", "a") as out:
            out.write(json.dumps(scores) + "\n")
        print(f"step {step}: {scores['agreement']:.1%} of {len(shown)} samples have their caption's colour")


def plot_losses(losses: list[float], path: Path, prediction: str = "v_prediction") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=0.8)
    target = {"epsilon": "noise", "v_prediction": "velocity", "sample": "latents"}[prediction]
    ax.set(xlabel="step", ylabel=f"MSE of the predicted {target}", yscale="log", title="UNet training")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    args = arguments()
    ctx = tessera.launch_from_torch(args.config)
    torch.manual_seed(args.seed)
    parts = build_parts(width=args.width, prediction_type=args.prediction, seed=args.seed)
    fit_vae(parts, steps=args.vae_steps, seed=args.seed)  # the same on every rank: same seed, same ops
    fit_text_encoder(parts, steps=args.text_steps, seed=args.seed)
    if args.checkpoint_blocks:
        checkpoint_unet_blocks(parts.unet)
    model = NoisePrediction(parts)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    engine, *_ = tessera.initialize(model, optimizer)
    run_dir = Path(args.run_dir)
    rank = ctx.rank
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({**vars(args), "world_size": ctx.world_size}, indent=1))
    data = ShapesDataset(
        args.steps * args.batch, parts.tokenize, parts.latent_shape, uncaptioned=args.uncaptioned, seed=args.seed
    )
    replicas, replica = ctx.size("data"), ctx.local_rank("data")
    write_samples(engine, parts, run_dir, 0, args, rank)
    losses = []
    accumulation = tessera.current_config().gradient_accumulation
    for step in range(args.steps):
        mine = local_batch(data, step, args.batch, replicas, replica)
        micro = [{k: v.chunk(accumulation)[i] for k, v in mine.items()} for i in range(accumulation)]
        losses.append(engine.train_batch(iter(micro)))
        if rank == 0:
            with open(run_dir / "metrics.jsonl", "a") as out:
                out.write(json.dumps({"step": step + 1, "loss": losses[-1]}) + "\n")
        if args.sample_every and (step + 1) % args.sample_every == 0 and step + 1 < args.steps:
            write_samples(engine, parts, run_dir, step + 1, args, rank)
    write_samples(engine, parts, run_dir, args.steps, args, rank)
    plain = trained_parts(engine, parts)
    if rank == 0:
        plot_losses(losses, run_dir / "loss.png", args.prediction)
        save_folder(plain, run_dir / "diffusers")
        print(f"{args.steps} steps, last loss {losses[-1]:.4f}; samples and diffusers/ in {run_dir}")
    engine.close()
    tessera.shutdown()


if __name__ == "__main__":
    main()
