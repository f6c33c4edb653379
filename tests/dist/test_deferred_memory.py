"""Start-up memory under deferred initialisation: from the baseline to a model ready for its
first step, each rank's peak RSS stays within baseline + its share of the parameters + the
largest parameter (+15%), where a whole build exceeds it; loading a full-state safetensors file
keeps the same bound and gives the single-process state."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.bench.init import LAYOUTS, MINIATURE, _build, parameter_sizes
from tessera.bench.zero_ranks import trim_heap
from tessera.checkpoint import full_state_dict, save_weights
from tessera.memory.report import peak_rss_bytes, reset_peak_rss
from tessera.models import NextTokenLoss, gpt
from tessera.testing import use_layout

# about 49M parameters (195 MB in fp32): well above the 15% slack on a ~300 MB baseline
PRESET, OVERRIDES = "small", {"vocab_size": 8192, "d_model": 768, "n_layers": 6, "n_heads": 12, "max_seq_len": 64}
LAYOUT_ARGS = {"2d-tp4": ({"tensor": 4, "mode": "2d"}, {"parallel": {"tensor": {"size": 4, "mode": "2d"}}})}


def _peak_while(build) -> tuple[int, int, object]:
    """(baseline RSS, peak RSS while ``build()`` runs, what it built)."""
    trim_heap()
    assert reset_peak_rss(), "the peak RSS could not be reset (/proc/self/clear_refs)"
    base = peak_rss_bytes()
    built = build()
    peak = peak_rss_bytes()
    assert base is not None and peak is not None
    return base, peak, built


def startup_body(layout: str, whole: bool):
    dims, config = LAYOUTS[layout] if layout in LAYOUTS else LAYOUT_ARGS[layout]
    use_layout(**dims, config=config)
    side = "tessera (whole build)" if whole else "tessera"
    _build(side, layout, "tiny", MINIATURE)  # imports and one-time set-up first (dropped at once)
    base, peak, built = _peak_while(lambda: _build(side, layout, PRESET, OVERRIDES))
    del built
    return base, peak


def file_body(layout: str, path: str):
    dims, config = LAYOUTS[layout] if layout in LAYOUTS else LAYOUT_ARGS[layout]
    use_layout(**dims, config=config)
    _build("tessera", layout, "tiny", MINIATURE)

    def build():
        torch.manual_seed(123)  # not the file's seed: the values must come from the file
        with tessera.deferred_init():
            model = gpt(PRESET, **OVERRIDES)
        return tessera.initialize(model, torch.optim.AdamW(model.parameters()), NextTokenLoss(), init=path)[0]

    base, peak, engine = _peak_while(build)
    state = full_state_dict(engine)
    return base, peak, state if torch.distributed.get_rank() == 0 else None


def _bound(base: int) -> float:
    total, largest = parameter_sizes(PRESET, OVERRIDES)
    return (base + total / 4 + largest) * 1.15


@pytest.mark.parametrize("layout", ["zero3", "tp4", "pp4"])
def test_startup_peak_stays_within_share_plus_largest_parameter(pools, layout):
    total, _ = parameter_sizes(PRESET, OVERRIDES)
    for base, peak in pools.run(4, startup_body, layout, False, timeout=600):
        assert peak <= _bound(base), f"{layout}: peak {peak / 2**20:.0f} MiB over {_bound(base) / 2**20:.0f} MiB"
    if layout == "tp4":
        return  # tensor-parallel layers build and shard one layer at a time even without deferred_init
    whole = pools.run(4, startup_body, layout, True, timeout=600)
    assert max(peak - _bound(base) for base, peak in whole) > total / 8, "a whole build exceeds the bound by far"


@pytest.fixture(scope="module")
def full_file(tmp_path_factory):
    torch.manual_seed(7)
    model = gpt(PRESET, **OVERRIDES)
    path = tmp_path_factory.mktemp("weights") / "full.safetensors"
    save_weights(full_state_dict(model), path)
    return str(path), {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("layout", ["2d-tp4", "zero3"])
def test_a_full_state_file_loads_into_shards_within_the_bound(pools, full_file, layout):
    path, expected = full_file
    results = pools.run(4, file_body, layout, path, timeout=600)
    for base, peak, _ in results:
        assert peak <= _bound(base), f"{layout}: peak {peak / 2**20:.0f} MiB over {_bound(base) / 2**20:.0f} MiB"
    state = results[0][2]
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def checkpoint_body(layout: str, path: str):
    dims, config = LAYOUTS[layout] if layout in LAYOUTS else LAYOUT_ARGS[layout]
    use_layout(**dims, config=config)
    torch.manual_seed(123)
    with tessera.deferred_init():
        model = gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=4, n_heads=4)
    engine = tessera.initialize(model, torch.optim.AdamW(model.parameters()), NextTokenLoss(), init=path)[0]
    state = full_state_dict(engine)
    return state if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("layout", ["2d-tp4", "zero3", "pp4"])
def test_a_checkpoint_folder_from_one_process_fills_a_deferred_model_in_any_layout(pools, tmp_path, layout):
    from tessera.checkpoint import save

    use_layout(config={})
    torch.manual_seed(7)
    model = gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=4, n_heads=4)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    engine = tessera.initialize(model, torch.optim.AdamW(model.parameters()), NextTokenLoss())[0]
    save(tmp_path / "ckpt", engine)
    state = pools.run(4, checkpoint_body, layout, str(tmp_path / "ckpt"))[0]
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
