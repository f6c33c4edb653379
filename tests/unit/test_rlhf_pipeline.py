"""The RLHF pipeline's config (tessera.rlhf_pipeline): every bad config fails before a process
starts with a message that names the key; the plan of each example config; the reward's stop
penalty; the batching helpers; the SVG plots (tessera.rlhf.plots); the docs list every key."""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from tessera import cli
from tessera.checkpoint import save_weights
from tessera.errors import ConfigError
from tessera.models import gpt
from tessera.rlhf import sorting_reward, value_model
from tessera.rlhf.plots import Panel, line_plot_svg, nice_ticks, plot_metrics
from tessera.rlhf_pipeline import STAGES, config_reference, load_stage_config, plan_stage
from tessera.rlhf_pipeline.build import StopPenalty, load_into, rule_reward
from tessera.rlhf_pipeline.config import ModelSpec
from tessera.rlhf_pipeline.output import summary
from tessera.rlhf_pipeline.plan import chunks, index_batches
from tessera.rlhf_pipeline.tokens import stop_ids

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "rlhf"
TINY = {"vocab_size": 256, "max_seq_len": 32, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32}
SVG = "{http://www.w3.org/2000/svg}"


def stage_folder(path: Path, *, value: bool = False, options: dict | None = None) -> Path:
    """A finished stage's folder: a tiny GPT's (or value model's) weights and its model.json."""
    options = options or TINY
    torch.manual_seed(0)
    model = value_model(gpt("tiny", **options)) if value else gpt("tiny", **options)
    save_weights(model.state_dict(), path / "model.safetensors")
    card = {"stage": "rm" if value else "sft", "value": value, "weights": "model.safetensors",
            "model": {"name": "gpt", "preset": "tiny", "options": options}}  # fmt: skip
    (path / "model.json").write_text(json.dumps(card))
    return path


def ppo(tmp_path: Path, **sections) -> dict:
    """A PPO config over 2 ranks: the actor on rank 0, the rest on rank 1, the rule reward."""
    sft = stage_folder(tmp_path / "sft")
    config = {
        "actor": {"ranks": [0], "init": str(sft)},
        "critic": {"ranks": [1]},
        "reference": {"ranks": [1]},
        "reward": {"rule": "sorting"},
        "train": {"batch_size": 8},
    }
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    return config


def refused(stage: str, config: dict, world: int = 2) -> str:
    with pytest.raises(ConfigError) as err:
        plan_stage(stage, load_stage_config(stage, config), world)
    return str(err.value)


# ---- keys and values --------------------------------------------------------------------------


def test_a_misspelt_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.optimiser'; did you mean 'actor.optimizer'"):
        load_stage_config("ppo", {"actor": {"optimiser": {"lr": 1e-5}}})
    with pytest.raises(ConfigError, match=r"unknown config key 'ppo'"):
        load_stage_config("sft", {"ppo": {"kl_coef": 0.1}})  # another stage's section
    with pytest.raises(ConfigError, match=r"unknown config key 'reference.optimizer'"):
        load_stage_config("ppo", {"reference": {"optimizer": {"lr": 1.0}}})  # a frozen model has no optimizer
    with pytest.raises(ConfigError, match=r"unknown stage 'sfx'"):
        load_stage_config("sfx", {})


def test_wrong_types_and_the_trainers_options_name_their_section():
    with pytest.raises(ConfigError, match=r"train.batch_size='8' must be of type int"):
        load_stage_config("sft", {"train": {"batch_size": "8"}})
    with pytest.raises(ConfigError, match=r"^ppo: kl_estimator must be one of"):
        load_stage_config("ppo", {"reward": {"rule": "sorting"}, "ppo": {"kl_estimator": "k9"}})
    with pytest.raises(ConfigError, match=r"^dpo: beta must be > 0"):
        load_stage_config("dpo", {"dpo": {"beta": 0}})
    with pytest.raises(ConfigError, match=r"^grpo: group_size must be >= 2"):
        load_stage_config("grpo", {"reward": {"rule": "sorting"}, "grpo": {"group_size": 1}})
    with pytest.raises(ConfigError, match=r"generation.temperature=0: GRPO"):
        load_stage_config("grpo", {"reward": {"rule": "sorting"}, "generation": {"temperature": 0}})
    with pytest.raises(ConfigError, match=r"^generation.max_tokens=0 must be an integer of at least 1"):
        load_stage_config("ppo", {"reward": {"rule": "sorting"}, "generation": {"max_tokens": 0}})
    with pytest.raises(ConfigError, match=r"unknown GPT preset 'huge'"):
        load_stage_config("sft", {"model": {"preset": "huge"}})


def test_the_reward_is_a_rule_or_a_folder_and_says_from():
    with pytest.raises(ConfigError, match=r"^reward: give one of reward.rule .* or reward.from "):
        load_stage_config("ppo", {})
    with pytest.raises(ConfigError, match=r"give one of reward.rule"):
        load_stage_config("ppo", {"reward": {"rule": "sorting", "from": "runs/rm"}})
    with pytest.raises(ConfigError, match=r"reward.rule='length' is not a known rule"):
        load_stage_config("ppo", {"reward": {"rule": "length"}})
    for placed in ({"ranks": [1]}, {"zero": {"stage": 3}}):
        with pytest.raises(ConfigError, match=r"reward.ranks and the layout sections place a reward model \(from\)"):
            load_stage_config("ppo", {"reward": {"rule": "sorting", **placed}})
    with pytest.raises(ConfigError, match=r"did you mean 'reward.from'"):
        load_stage_config("ppo", {"reward": {"frm": "x"}})
    cfg = load_stage_config("ppo", {}, ["reward.from=runs/rm"])  # --set spells it as the file does
    assert cfg.reward.from_ == "runs/rm"  # type: ignore[attr-defined]


def test_ranks_are_distinct_ascending_and_inside_the_job(tmp_path):
    with pytest.raises(ConfigError, match=r"actor.ranks=\[1, 0\]: give distinct ranks .* in ascending order"):
        load_stage_config("ppo", ppo(tmp_path, actor={"ranks": [1, 0]}))
    message = refused("ppo", ppo(tmp_path, critic={"ranks": [1, 2]}))
    assert "critic.ranks=[1, 2]: rank(s) [2] are outside the job's 2 rank(s)" in message


def test_layouts_must_fit_their_ranks_and_the_trainers(tmp_path):
    message = refused("ppo", ppo(tmp_path, critic={"parallel": {"tensor": 2}}))
    assert message.startswith("critic.parallel:") and "(it has 1 rank(s): [1])" in message
    message = refused("ppo", ppo(tmp_path, actor={"ranks": [0, 1], "parallel": {"tensor": 2}}))
    assert "actor: each of its data ranks generates rollouts with the whole model" in message
    with pytest.raises(ConfigError, match=r"policy.parallel.pipeline.size=2: .* not supported"):
        load_stage_config("sft", {"policy": {"parallel": {"pipeline": 2}}})
    with pytest.raises(ConfigError, match=r"reference.parallel.sequence.size=2"):
        load_stage_config("ppo", {"reward": {"rule": "sorting"}, "reference": {"parallel": {"sequence": 2}}})
    with pytest.raises(ConfigError, match=r"policy.parallel.auto"):
        load_stage_config("dpo", {"policy": {"parallel": "auto"}})
    # the tessera config's own rules, under the model's name
    with pytest.raises(ConfigError, match=r"^policy.zero.offload_optimizer='cpu' needs stage >= 1"):
        load_stage_config("sft", {"policy": {"zero": {"offload_optimizer": "cpu"}}})
    with pytest.raises(ConfigError, match=r"^policy: clip_grad_norm=-1.0 must be positive"):
        plan_stage("sft", load_stage_config("sft", {"policy": {"clip_grad_norm": -1}}), 1)


def test_batches_must_split_over_data_ranks_and_accumulation(tmp_path):
    cfg = {"policy": {"gradient_accumulation": 2}, "train": {"batch_size": 6}}
    message = refused("sft", cfg, world=2)
    assert "train.batch_size=6 over policy's data ranks x gradient_accumulation (2 x 2)" in message
    plan_stage("sft", load_stage_config("sft", {**cfg, "train": {"batch_size": 8}}), 2)
    message = refused("ppo", ppo(tmp_path, train={"batch_size": 6}, ppo={"minibatches": 4}))
    assert "the rollout batch (6 rows: train.batch_size) over minibatches=4" in message
    message = refused("ppo", ppo(tmp_path, critic={"ranks": [0, 1], "gradient_accumulation": 8}))
    assert "a minibatch (8 rows) over the critic's data ranks x gradient_accumulation (2 x 8)" in message
    message = refused("grpo", {"actor": {"parallel": {"data": 2}}, "reward": {"rule": "sorting"},
                               "train": {"batch_size": 3}, "grpo": {"group_size": 3}})  # fmt: skip
    assert "the rollout batch (9 rows: train.batch_size x grpo.group_size)" in message


def test_weights_come_from_stage_folders_that_exist_and_fit(tmp_path):
    message = refused("rm", {"reward_model": {"init": str(tmp_path / "nowhere")}}, world=1)
    assert "reward_model.init=" in message and "neither a stage's output folder nor a .safetensors file" in message
    (tmp_path / "empty").mkdir()
    message = refused("rm", {"reward_model": {"init": str(tmp_path / "empty")}}, world=1)
    assert "the folder has no model.safetensors" in message
    message = refused("ppo", ppo(tmp_path, reward={"rule": None, "from": str(tmp_path / "sft")}))
    assert "is not a reward model's folder" in message
    # the folder names its architecture; a model section that disagrees is refused
    message = refused("ppo", {**ppo(tmp_path), "model": {"preset": "tiny", "options": {"n_layers": 3}}})
    assert "actor.: " in message and "other than the config's model section" in message
    plans = plan_stage("ppo", load_stage_config("ppo", ppo(tmp_path)), 2)
    assert list(plans) == ["actor", "critic", "reference"]
    assert all(p.spec == ModelSpec("gpt", "tiny", TINY) for p in plans.values())
    assert plans["critic"].value and plans["critic"].weights == tmp_path / "sft" / "model.safetensors"


def test_value_weights_do_not_load_into_a_causal_lm_and_the_backbone_does_into_a_value_model(tmp_path):
    rm = stage_folder(tmp_path / "rm", value=True)
    sft = stage_folder(tmp_path / "sft")
    with pytest.raises(ConfigError, match=r"actor: .* holds a value model .*, not a causal LM"):
        load_into(gpt("tiny", **TINY), rm / "model.safetensors", "actor")
    torch.manual_seed(1)
    critic = value_model(gpt("tiny", **TINY), head_std=0.0)
    load_into(critic, sft / "model.safetensors", "critic")
    assert torch.equal(critic.tok_emb.weight, gpt_weights(sft)["tok_emb.weight"])
    assert float(critic.score.weight.detach().abs().sum()) == 0.0  # the head stays the critic's own
    with pytest.raises(ConfigError, match=r"critic: .* does not fit the model"):
        load_into(value_model(gpt("tiny", **{**TINY, "n_layers": 2})), sft / "model.safetensors", "critic")


def gpt_weights(folder: Path) -> dict:
    from tessera.checkpoint import load_weights

    return load_weights(folder / "model.safetensors")


def test_the_example_configs_load_and_plan(tmp_path, monkeypatch):
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert {f.stem for f in files} >= set(STAGES)
    monkeypatch.chdir(tmp_path)  # the examples' stage folders, made here
    for stage in ("sft", "rm"):
        stage_folder(Path("runs/rlhf-example") / stage, value=stage == "rm", options=EXAMPLE_MODEL)
    for path in files:
        stage = path.stem.split("-")[0]
        cfg = load_stage_config(stage, path)
        plans = plan_stage(stage, cfg, cfg.launch.nproc_per_node)
        assert plans, path


EXAMPLE_MODEL = {"vocab_size": 256, "max_seq_len": 48, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128,
                 "dropout": 0.0}  # fmt: skip


# ---- the reward's stop penalty, the batching helpers, the summary -------------------------------


def test_a_response_cut_before_its_stop_token_scores_lower():
    from tessera.inference.text import ByteTokenizer

    tok = ByteTokenizer()
    stops = stop_ids(load_stage_config("ppo", {"reward": {"rule": "sorting"}}).generation, tok)  # type: ignore[attr-defined]
    assert stops == (10,)
    score = rule_reward(sorting_reward, tok, stops, penalty=0.5)
    prompt = tok.encode("sort 3 1 2:")
    assert score(prompt, tok.encode(" 1 2 3\n")) == 1.0
    assert score(prompt, tok.encode(" 1 2 3")) == pytest.approx(sorting_reward("sort 3 1 2:", " 1 2 3") - 0.5)

    class Values(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return torch.ones(input_ids.shape)

    ids = torch.tensor([[5, 6, 10], [5, 10, 7]])
    values = StopPenalty(Values(), stops, 2.0)(ids)
    assert values.tolist() == [[-1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]]


def test_index_batches_cycle_through_seeded_epochs_and_chunks_split_evenly():
    batches = index_batches(10, 4, shuffle=True, seed=0)
    first = [next(batches) for _ in range(2)]  # an epoch: 2 batches of 4, the last 2 rows dropped
    assert len({i for b in first for i in b}) == 8
    assert first == [b for b, _ in zip(index_batches(10, 4, shuffle=True, seed=0), range(2))]  # the same on every rank
    assert next(index_batches(10, 4, shuffle=False, seed=0)) == [0, 1, 2, 3]
    assert chunks([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4, 5]] and chunks([1, 2, 3, 4], 4) == [[1], [2], [3], [4]]
    with pytest.raises(ConfigError, match=r"train.batch_size=4 is larger than the 3 training rows"):
        next(index_batches(3, 4, shuffle=True, seed=0))


def test_the_summary_averages_the_first_and_last_tenth_of_the_steps():
    records = [{"step": 0, "time": 0.0, "eval/reward": 0.5}]
    records += [{"step": s, "time": float(s), "reward": float(s)} for s in range(1, 21)]
    records[-1]["eval/reward"] = 0.9
    figures = summary("ppo", records, 12.345, 20)
    assert figures["train_first"] == {"reward": 1.5} and figures["train_last"] == {"reward": 19.5}
    assert figures["eval_first"] == {"reward": 0.5, "step": 0} and figures["eval_last"] == {"reward": 0.9, "step": 20}
    assert figures["seconds"] == 12.35


# ---- the command line ---------------------------------------------------------------------------


def test_tessera_rlhf_refuses_a_bad_plan_before_starting_processes(tmp_path, capsys):
    config = tmp_path / "ppo.json"
    config.write_text(json.dumps(ppo(tmp_path)))
    code = cli.main(["rlhf", "ppo", str(config), "--nproc-per-node", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "actor.ranks" not in err and "critic.ranks=[1]: rank(s) [1] are outside the job's 1 rank(s)" in err
    assert "(tessera rlhf starts 1 process(es): --nproc-per-node)" in err
    assert cli.main(["rlhf", "ppo", str(config), "--set", "ppo.epochs=0"]) == 2
    assert "ppo: epochs and minibatches must be >= 1" in capsys.readouterr().err


# ---- plots ------------------------------------------------------------------------------------


def test_nice_ticks_are_round_and_cover_the_range():
    assert nice_ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(3.0, 97.0) == [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]
    ticks = nice_ticks(-0.013, 0.021)
    assert ticks[0] <= -0.013 and ticks[-1] >= 0.021 and len(ticks) <= 9
    assert nice_ticks(2.0, 2.0) == [1.8, 1.9, 2.0, 2.1, 2.2]  # a flat line gets a range around it
    with pytest.raises(ValueError, match="finite"):
        nice_ticks(0.0, math.inf)


def test_a_line_plot_is_an_svg_with_a_line_per_series_and_its_legend():
    svg = line_plot_svg(
        [("train", [(1, 2.0), (2, 1.5), (3, math.nan), (4, 1.0)]), ("empty", [(1, math.inf)]), ("eval", [(4, 1.2)])],
        title="loss <nats>",
        ylabel="loss",
    )
    root = ET.fromstring(svg)
    lines = root.findall(f"{SVG}polyline")
    assert len(lines) == 2  # the series without a finite point is left out
    assert len(lines[0].get("points", "").split()) == 3  # the nan point is left out
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "loss <nats>" in texts and "train" in texts and "eval" in texts and "empty" not in texts
    with pytest.raises(ValueError, match="no finite point"):
        line_plot_svg([("x", [(0, math.nan)])], title="t")


def test_plot_metrics_writes_a_chart_per_panel_with_data(tmp_path):
    records = [{"step": 0, "eval/reward": 0.2}, {"step": 1, "reward": 0.3, "kl": 0.1}, {"step": 2, "reward": 0.5}]
    panels = [Panel("reward", "R", "r", (("train", "reward"), ("held-out", "eval/reward"))),
              Panel("loss", "L", "l", (("policy", "policy/loss"),))]  # fmt: skip
    written = plot_metrics(records, panels, tmp_path)
    assert [p.name for p in written] == ["reward.svg"]  # no loss recorded: no loss chart
    root = ET.fromstring((tmp_path / "reward.svg").read_text())
    assert len(root.findall(f"{SVG}polyline")) == 2


# ---- docs ---------------------------------------------------------------------------------------


MODEL_SECTIONS = ("policy", "reward_model", "actor", "critic", "reference", "reward")


def test_the_docs_page_lists_every_key_of_every_stage():
    """Every key in backticks: whole, or for a model's section its name and the key inside it
    (the page has one table of the keys every model section takes)."""
    page = (REPO / "docs" / "rlhf-pipeline.md").read_text()
    documented = set(re.findall(r"`([a-z_][a-z_0-9.]*)`", page))

    def listed(key: str) -> bool:
        section, _, inside = key.partition(".")
        return key in documented or (section in MODEL_SECTIONS and {section, inside} <= documented)

    missing = {f"{stage}: {key}" for stage in STAGES for key, *_ in config_reference(stage) if not listed(key)}
    assert not missing, f"docs/rlhf-pipeline.md lacks {sorted(missing)}"
