"""``tessera bench diffusion``'s video rows at tiny sizes: the longest-clip search runs on 1, 2
and 4 ranks in both modes and gives rows (the numbers themselves come from the bench's fresh
processes, docs/video.md)."""

from __future__ import annotations

import pytest

from tessera.bench import video
from tests.e2e.test_bench import check


def test_bench_video_longest_clip_rows(tmp_path, pools):
    # frames of 8x8 latents, a width of 32: 8 and 16 frames both fit a generous budget
    search = video.ClipSearch(budget=512 * 2**20, grain=8, max_frames=16, bisections=0, size=8, d_model=32)
    rows, found = video.longest_clip_rows(search, pools)
    data = check(rows, tmp_path, {"frames"})
    assert [row["name"] for row in data] == [
        "longest clip sp all_to_all x2 vs sp1",
        "longest clip sp ring x2 vs sp1",
        "longest clip sp all_to_all x4 vs sp1",
        "longest clip sp ring x4 vs sp1",
    ]
    assert all(set(seen) == {8, 16} for seen in found.values()), found
    assert all(row["value"] == 16 and row["anchor_value"] == 16 for row in data), data


def test_a_grain_that_ring_mode_cannot_split_is_refused():
    with pytest.raises(ValueError, match="grain=4 must divide by 2 \\* 4"):
        video.longest_clip_rows(video.ClipSearch(grain=4))
