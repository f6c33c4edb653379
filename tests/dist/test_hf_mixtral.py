"""An unmodified transformers Mixtral (4 experts, top-2, grouped-query attention) with its experts
spread by tessera's Mixtral policy over 2 and 4 ranks, beside data, 1D tensor and pipeline
parallelism: 6 AdamW steps give the losses and the weights of plain single-process transformers
on the whole batch (fp32, ``tessera.testing.tolerance``; Mixtral drops no token and its auxiliary
loss is off by default, so every rank's share of the batch routes as in one process), compared through the Hugging Face
state-dict keys. A dense model under an expert axis is refused at initialize."""

from __future__ import annotations

import pytest
import torch
import transformers

import tessera
from tessera.checkpoint import full_state_dict
from tessera.errors import ConfigError
from tessera.testing import tolerance, use_layout
from tests.dist.test_hf_tensor import loss_of, optimizer_of

STEPS, BATCH, SEQ, VOCAB, MICRO = 6, 8, 16, 64, 2


def build() -> torch.nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build()
    optimizer = optimizer_of(model)
    losses = []
    for x, y in batches():
        optimizer.zero_grad()
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(data: int, expert: int, tensor: int, pipeline: int):
    parallel = {"data": data, "expert": expert, "tensor": tensor}
    if pipeline > 1:
        parallel["pipeline"] = {"size": pipeline, "schedule": "1f1b", "microbatches": MICRO}
    ctx = use_layout(data=data, expert=expert, tensor=tensor, pipeline=pipeline, config={"parallel": parallel})
    model = build()
    keys = list(model.state_dict())
    engine, *_ = tessera.initialize(model, optimizer_of(model), loss_of)
    rows = BATCH // data
    mine = slice(ctx.local_rank("data") * rows, (ctx.local_rank("data") + 1) * rows)
    losses = []
    for x, y in batches():
        x, y = x[mine], y[mine]
        micro = [(x[k::MICRO], y[k::MICRO]) for k in range(MICRO)] if pipeline > 1 else [(x, y)]
        losses.append(float(engine.train_batch(iter(micro))))
    spread = sorted({type(m).__name__ for m in model.modules() if type(m).__module__ == "tessera.hf.mixtral"})
    local = model.get_submodule("model.layers.0.mlp.experts").gate_up_proj.shape
    return losses, full_state_dict(model), keys, spread, tuple(local)


LAYOUTS = {  # data, expert, tensor, pipeline
    "ep2": (2, 2, 1, 1),
    "ep4": (4, 4, 1, 1),
    "ep2xdp2": (4, 2, 1, 1),
    "ep2xtp2": (2, 2, 2, 1),
    "ep2xpp2": (2, 2, 1, 2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixtral_with_spread_experts_trains_as_in_one_process(pools, layout):
    data, expert, tensor, pipeline = LAYOUTS[layout]
    expected_losses, expected = reference()
    tol = tolerance(blocks=2, steps=STEPS)
    results = pools.run(data * tensor * pipeline, train, data, expert, tensor, pipeline, timeout=300)
    for losses, state, keys, spread, local in results:
        assert spread == ["SparseMoeBlock", "SpreadExperts"]
        assert local == (4 // expert, 2 * 24 // tensor, 32)  # this rank's experts, its block of their width
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **tol)
        assert set(state) == set(keys) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, **tol, msg=lambda m, key=key: key + m)


def dense_under_an_expert_axis() -> str:
    use_layout(data=2, expert=2, config={"parallel": {"data": 2, "expert": 2}})
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, max_position_embeddings=SEQ)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    try:
        tessera.initialize(model, optimizer_of(model), loss_of)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_a_dense_model_under_an_expert_axis_is_refused(pools):
    message = pools.run(2, dense_under_an_expert_axis)[0]
    assert "parallel.expert.size=2" in message and "LlamaForCausalLM" in message and "expert.size=1" in message


def load_folder(folder: str) -> dict[str, torch.Tensor]:
    use_layout(data=2, expert=2, tensor=2, config={"parallel": {"data": 2, "expert": 2, "tensor": 2}})
    # transformers reads the folder (it converts Mixtral's per-expert keys to the fused weights on
    # load; tessera.hf.from_pretrained refuses checkpoints converted on load), the policy splits it
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    engine, *_ = tessera.initialize(model, optimizer_of(model), loss_of)
    x, _ = batches()[0]
    with torch.no_grad():
        logits = engine(x).logits
    return {"state": full_state_dict(model), "logits": logits}


def test_a_loaded_mixtral_keeps_its_weights_and_logits_when_spread(pools, tmp_path):
    """Saved by transformers, loaded by transformers on each rank and spread under ep2 x tp2: each
    rank keeps its experts and its block of their width; the whole model and its logits are the
    folder's (the fused gate/up weight's halves each split as the policy splits them)."""
    model = build()
    model.save_pretrained(tmp_path, safe_serialization=True)
    x, _ = batches()[0]
    with torch.no_grad():
        expected_logits = model(x).logits
    for r in pools.run(4, load_folder, str(tmp_path), timeout=300):
        for key, value in model.state_dict().items():
            torch.testing.assert_close(r["state"][key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(r["logits"], expected_logits, **tolerance(blocks=2))
