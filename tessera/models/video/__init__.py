"""A video diffusion transformer (Open-Sora-like ST-DiT) trained with rectified flow, its
synthetic moving-shapes clips, sampling, and its split over the sequence axis (docs/video.md)."""

from tessera.models.video.data import MovingShapes, all_specs, caption_ids, render
from tessera.models.video.model import VideoDiT, VideoDiTConfig, VideoOutput, patchify, unpatchify
from tessera.models.video.sampling import sample, write_frame_strip, write_gif
from tessera.models.video.sequence import FrameSplit, frame_layout, take_frames

__all__ = [
    "FrameSplit",
    "MovingShapes",
    "VideoDiT",
    "VideoDiTConfig",
    "VideoOutput",
    "all_specs",
    "caption_ids",
    "frame_layout",
    "patchify",
    "render",
    "sample",
    "take_frames",
    "unpatchify",
    "write_frame_strip",
    "write_gif",
]
