"""Config loading and validation: every failure names the key and the rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

import tessera
from tessera.config import (
    Config,
    apply_overrides,
    check_model_layout,
    load_config,
    parallel_dims,
    read_config_file,
    reference_markdown,
    render_docs,
    require_available,
)
from tessera.context import ParallelDims
from tessera.errors import ConfigError, NotAvailableError
from tessera.testing import free_port

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_misspelt_top_level_key_is_named_with_a_suggestion(tmp_path):
    path = write(tmp_path, "bad.py", "paralel = dict(data=2)\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "'paralel'" in str(err.value)
    assert "did you mean 'parallel'" in str(err.value)


def test_misspelt_nested_key_names_its_full_path():
    with pytest.raises(ConfigError, match=r"parallel\.tensor\.sise.*did you mean 'parallel\.tensor\.size'"):
        load_config({"parallel": {"tensor": {"sise": 4}}})


def test_launch_fails_on_a_bad_config_before_any_process_group():
    # world_size=2 with no second rank: reaching init_process_group would hang, so a pass
    # proves the config was rejected first.
    with pytest.raises(ConfigError, match="paralel"):
        tessera.launch({"paralel": {"data": 2}}, rank=0, world_size=2, port=free_port())
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("tensor", "rule"),
    [
        (dict(size=3, mode="2d"), "must be a square"),
        (dict(size=8, mode="2d"), "must be a square"),
        (dict(size=4, mode="3d"), "must be a cube"),
        (dict(size=8, mode="2.5d", depth=3), "must be depth \\* q\\^2"),
        (dict(size=4, mode="1d", depth=2), "only used by mode '2.5d'"),
        (dict(size=4, mode="4d"), "allowed: '1d', '2d', '2.5d', '3d'"),
        (dict(size=4, mode="2d", sequence_parallel=True), "needs mode '1d'"),
        (dict(size=4, mode="1d", keep_blocks=True), "keep_blocks=True keeps .* mode '1d' moves none"),
    ],
)
def test_tensor_rules_are_named(tensor, rule):
    with pytest.raises(ConfigError, match=rule):
        load_config({"parallel": {"tensor": tensor}})


def test_tensor_layouts_that_fit_are_accepted():
    for tensor in (
        dict(size=4, mode="2d"),
        dict(size=8, mode="2.5d", depth=2),
        dict(size=8, mode="3d"),
        dict(size=6, mode="1d"),
        dict(size=4, mode="2.5d", depth=1),
    ):
        assert load_config({"parallel": {"tensor": tensor}}).parallel.tensor.size == tensor["size"]


def test_layout_that_does_not_fit_the_world_names_the_numbers():
    cfg = load_config({"parallel": {"data": 3, "tensor": {"size": 4, "mode": "2d"}}})
    with pytest.raises(ConfigError, match=r"data=3 x pipeline=1 x sequence=1 x tensor=4 = 12, but the world size is 8"):
        parallel_dims(cfg, 8)
    cfg = load_config({"parallel": {"pipeline": 3}})
    with pytest.raises(ConfigError, match=r"= 3 does not divide world size 8"):
        parallel_dims(cfg, 8)
    assert parallel_dims(load_config({"parallel": {"pipeline": 2, "tensor": 2}}), 8).data == 2


def test_every_format_gives_the_same_config(tmp_path):
    expected = load_config(
        {
            "parallel": {"data": 2, "tensor": {"size": 4, "mode": "2d"}},
            "zero": {"stage": 2},
            "clip_grad_norm": 1.0,
            "gradient_accumulation": 4,
        }
    )
    py = write(
        tmp_path,
        "c.py",
        '"""doc"""\n_q = 2\nparallel = dict(data=2, tensor=dict(size=_q * _q, mode="2d"))\n'
        "zero = dict(stage=2)\nclip_grad_norm = 1.0\ngradient_accumulation = 2 ** 2\n",
    )
    yaml = write(
        tmp_path,
        "c.yaml",
        "parallel:\n  data: 2\n  tensor: {size: 4, mode: 2d}\nzero: {stage: 2}\n"
        "clip_grad_norm: 1.0\ngradient_accumulation: 4\n",
    )
    toml = write(
        tmp_path,
        "c.toml",
        "clip_grad_norm = 1.0\ngradient_accumulation = 4\n[parallel]\ndata = 2\n"
        '[parallel.tensor]\nsize = 4\nmode = "2d"\n[zero]\nstage = 2\n',
    )
    js = write(
        tmp_path,
        "c.json",
        json.dumps(
            {
                "parallel": {"data": 2, "tensor": {"size": 4, "mode": "2d"}},
                "zero": {"stage": 2},
                "clip_grad_norm": 1.0,
                "gradient_accumulation": 4,
            }
        ),
    )
    for path in (py, yaml, toml, js):
        assert load_config(path) == expected, path.suffix


def test_yaml_reads_exponents_as_numbers(tmp_path):
    """PyYAML alone reads ``1e-5`` as a string (YAML 1.1 wants ``1.0e-5``); a config takes it
    as the number it is, and other strings stay strings."""
    path = write(tmp_path, "c.yaml", "a: 1e-5\nb: -3E4\nc: 2.5e+2\nd: .5\ne: 1_000\nf: 1e\ng: e5\nh: 2d\ni: '1e-5'\n")
    assert read_config_file(path) == {
        "a": 1e-5, "b": -3e4, "c": 250.0, "d": 0.5, "e": 1000, "f": "1e", "g": "e5", "h": "2d", "i": "1e-5"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("import os\n", "only assignments"),
        ("parallel = dict(data=len('ab'))\n", "plain values"),
        ("parallel = dict(data=q)\n", "name 'q' is not assigned"),
        ("def f():\n    pass\n", "only assignments"),
    ],
)
def test_py_configs_are_parsed_not_executed(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, "c.py", text))


def test_wrong_types_name_key_and_type():
    with pytest.raises(ConfigError, match=r"parallel\.tensor\.size='4' must be of type int"):
        load_config({"parallel": {"tensor": {"size": "4"}}})
    with pytest.raises(ConfigError, match=r"zero\.overlap_comm=1 must be of type bool"):
        load_config({"zero": {"overlap_comm": 1}})
    with pytest.raises(ConfigError, match=r"zero\.stage=5 is not a ZeRO stage"):
        load_config({"zero": {"stage": 5}})
    with pytest.raises(ConfigError, match=r"mixed_precision\.dtype='fp8' is not allowed"):
        load_config({"mixed_precision": {"dtype": "fp8"}})


def test_command_line_overrides():
    cfg = load_config(
        {"parallel": {"tensor": 2}},
        ["parallel.tensor.size=4", "parallel.tensor.mode=2d", "clip_grad_norm=0.5", "trainer.steps=none"],
    )
    assert cfg.parallel.tensor.size == 4 and cfg.parallel.tensor.mode == "2d"
    assert cfg.clip_grad_norm == 0.5 and cfg.trainer.steps is None
    assert apply_overrides({"a": 1}, ["b.c=true"]) == {"a": 1, "b": {"c": True}}
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, ["parallel.tensor.size"])
    with pytest.raises(ConfigError, match="did you mean 'parallel.tensor'"):
        load_config(None, ["parallel.tenser.size=2"])


def test_pipeline_rules_at_config_time():
    with pytest.raises(ConfigError, match="microbatches=2 is fewer than the 4 stages"):
        load_config({"parallel": {"pipeline": {"size": 4, "microbatches": 2}}})
    assert load_config({"parallel": {"pipeline": {"size": 4, "microbatches": 2, "schedule": "gpipe"}}})
    with pytest.raises(ConfigError, match="needs schedule='interleaved'"):
        load_config({"parallel": {"pipeline": {"size": 2, "chunks": 2}}})


def test_more_pipeline_parts_than_model_layers_fail_at_config_time():
    # the tiny GPT gives 6 layers (embedding, 4 blocks, head)
    model = {"name": "gpt", "preset": "tiny"}
    assert load_config({"parallel": {"pipeline": {"size": 6}}, "model": model})
    with pytest.raises(ConfigError, match=r"size=8 needs 8 pipeline parts, but model 'gpt' .* has only 6 layers"):
        load_config({"parallel": {"pipeline": {"size": 8}}, "model": model})
    with pytest.raises(ConfigError, match=r"size=2 x chunks=4 needs 8 pipeline parts.*only 4 layers"):
        pipeline = {"size": 2, "schedule": "interleaved", "chunks": 4, "microbatches": 4}
        load_config({"parallel": {"pipeline": pipeline}, "model": {**model, "options": {"n_layers": 2}}})
    # no model section: the user brings their own model, whose layers are counted at initialize
    assert load_config({"parallel": {"pipeline": {"size": 8}}})
    # tessera train always builds config.model, so its command checks the default model too
    with pytest.raises(ConfigError, match="has only 6 layers"):
        check_model_layout(load_config({"parallel": {"pipeline": {"size": 8}}}))


def test_features_not_built_yet_fail_clearly_when_used(monkeypatch):
    require_available(load_config({}))
    require_available(load_config({"zero": {"stage": 2}}))  # built: accepted
    require_available(load_config({"gemini": {"device_budget": "1GiB"}}))  # built: accepted
    require_available(load_config({"parallel": {"sequence": {"size": 2, "mode": "all_to_all"}}}))  # built
    # the mechanism a feature announced in the config but not built yet goes through
    from tessera.config import loading

    planned = ("parallel.sequence.size", lambda c: c.parallel.sequence.size > 1, "sequence parallelism")
    monkeypatch.setattr(loading, "_NOT_BUILT", [planned])
    with pytest.raises(NotAvailableError, match=r"parallel\.sequence\.size: sequence parallelism is not available yet"):
        require_available(load_config({"parallel": {"sequence": {"size": 2}}}))


def test_sequence_parallelism_layouts_are_checked():
    with pytest.raises(ConfigError, match="ring_qk"):
        load_config({"parallel": {"sequence": {"size": 2, "mode": "ulysses"}}})
    with pytest.raises(ConfigError, match="sequence parallelism composes with 1d tensor parallelism"):
        load_config({"parallel": {"sequence": 2, "tensor": {"size": 4, "mode": "2d"}}})
    with pytest.raises(ConfigError, match="parallel.sequence.mode='ring_attention' is not one of"):
        ParallelDims(world_size=2, sequence=2, sequence_mode="ring_attention")
    assert ParallelDims(world_size=8, sequence=2, tensor=2, sequence_mode="ring_qk").data == 2
    assert load_config({"parallel": {"sequence": 2}, "gemini": {"enabled": True}}).gemini.active  # one optimizer now


def test_docs_reference_matches_the_code():
    page = (REPO / "docs" / "config.md").read_text()
    assert render_docs(page) == page, "docs/config.md is stale: run python -m tessera.config docs/config.md"
    for section in ("parallel.tensor", "zero", "gemini", "mixed_precision", "trainer"):
        assert f"### `{section}`" in reference_markdown()


def test_config_object_passes_through():
    cfg = Config()
    assert load_config(cfg) is cfg
    assert load_config(cfg, ["seed=7"]).seed == 7


def test_keep_blocks_reaches_the_layout_from_the_config():
    # off by default; the layers read it from ParallelDims, as sequence_parallel
    assert parallel_dims(load_config({"parallel": {"tensor": dict(size=4, mode="2d")}}), 4).keep_blocks is False
    for tensor in (dict(size=4, mode="2d"), dict(size=8, mode="2.5d", depth=2), dict(size=8, mode="3d")):
        cfg = load_config({"parallel": {"tensor": dict(tensor, keep_blocks=True)}})
        assert parallel_dims(cfg, tensor["size"]).keep_blocks is True


def test_gemini_and_zero_take_an_expert_axis():
    assert load_config({"parallel": {"data": 4, "expert": 2}, "gemini": {"enabled": True}}).gemini.active
    assert load_config({"parallel": {"data": 4, "expert": 2}, "zero": {"stage": 3}}).zero.stage == 3


def test_the_old_zero_bucket_mb_key_still_works_and_warns_naming_chunk_mb():
    with pytest.warns(FutureWarning, match="'zero.bucket_mb' is deprecated: use 'zero.chunk_mb'"):
        cfg = load_config({"zero": {"stage": 2, "bucket_mb": 3.5}})
    assert cfg.zero.chunk_mb == 3.5
    with pytest.warns(FutureWarning, match="zero.chunk_mb"):
        assert load_config(None, ["zero.stage=1", "zero.bucket_mb=2"]).zero.chunk_mb == 2
    with pytest.raises(ConfigError, match="'zero.bucket_mb' and 'zero.chunk_mb' both given"):
        load_config({"zero": {"bucket_mb": 1, "chunk_mb": 2}})
