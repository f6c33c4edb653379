"""Unmodified transformers encoders (BERT with its masked-LM head tied to the word embedding,
bias included; ViT on synthetic images) under 1D tensor parallelism by their tessera.hf
policies, with and without sequence-parallel regions and beside data parallelism: 10 AdamW
steps give the losses and the weights of plain single-process transformers (fp32,
``tessera.testing.tolerance``), compared through the Hugging Face state-dict keys. Also: BERT with padded sequences (an
attention mask) and token types, the classifiers and the base model (pooler left whole), and a
ViT whose sequence the tensor size does not divide refused at initialize."""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.nn.functional as F
import transformers

import tessera
from tessera.checkpoint import full_state_dict
from tessera.errors import ConfigError
from tessera.testing import tolerance
from tests.dist.test_hf_tensor import LAYOUTS, layout

STEPS = 10
TOL = tolerance(blocks=2, steps=STEPS)  # build(): 2 layers
BATCH, SEQ, VOCAB, HIDDEN = 8, 16, 67, 32  # the vocabulary does not divide the tensor size
MASK_ID, MASKED = 3, 4  # each sequence has MASKED positions to predict (equal counts: dp halves average)
IMAGE, PATCH, CLASSES = 6, 2, 5  # 1 + 3 * 3 = 10 tokens per image


def build(family: str, **overrides) -> torch.nn.Module:
    """A small random model of ``family``, the same on every rank and in the reference."""
    dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if family == "vit":
        fields = dict(
            image_size=IMAGE, patch_size=PATCH, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=50, num_labels=CLASSES, **dropout,
        )  # fmt: skip
        config = transformers.ViTConfig(**(fields | overrides))
        kind = transformers.ViTForImageClassification
    else:  # an MLP width (50) that 4 does not divide
        fields = dict(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=50,
            max_position_embeddings=SEQ, type_vocab_size=2, num_labels=3, **dropout,
        )  # fmt: skip
        config = transformers.BertConfig(**(fields | overrides))
        kind = {
            "bert-classifier": transformers.BertForSequenceClassification,
            "bert-token-classifier": transformers.BertForTokenClassification,
            "bert-base": transformers.BertModel,
        }.get(family, transformers.BertForMaskedLM)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return kind(config)


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW as in test_hf_tensor (eps 1e-3), ViT at a lower rate: its gradients here reach 2e-2,
    over ten times BERT's, and each one's rounding (about 1e-6 of the tensor's largest entry, as
    much in single-process fp32 against fp64 as in any layout) passes through Adam into every
    step: at lr 1e-2 ten steps bring single weights to the 1e-6 tolerance, at 3e-3 a fifth of it."""
    lr = 3e-3 if model.config.model_type == "vit" else 1e-2
    return torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-3)


def _masked_lm(ids: torch.Tensor, lengths: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` with MASKED positions of each row's first ``length`` replaced by the mask token, and
    the labels: the original ids there, -100 (ignored) elsewhere."""
    ids, labels = ids.clone(), torch.full_like(ids, -100)
    for row, length in enumerate(lengths.tolist()):
        where = torch.randperm(length, generator=g)[:MASKED]
        labels[row, where] = ids[row, where]
        ids[row, where] = MASK_ID
    return ids, labels


def batches(family: str) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """Per step: the model's positional inputs and the targets."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        if family == "vit":
            images = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)
            out.append(((images,), torch.randint(0, CLASSES, (BATCH,), generator=g)))
            continue
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        if family == "bert":
            ids, labels = _masked_lm(ids, torch.full((BATCH,), SEQ), g)
            out.append(((ids,), labels))
            continue
        lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=g)
        mask = (torch.arange(SEQ) < lengths[:, None]).long()
        ids = ids * mask  # padding: token 0, the embedding's padding_idx
        types = (torch.arange(SEQ) >= lengths[:, None] // 2).long() * mask  # two segments
        if family == "bert-padded":
            ids, labels = _masked_lm(ids, lengths, g)
        elif family == "bert-classifier":
            labels = torch.randint(0, 3, (BATCH,), generator=g)
        elif family == "bert-token-classifier":  # padding ignored
            labels = torch.randint(0, 3, (BATCH, SEQ), generator=g).masked_fill(mask == 0, -100)
        else:  # bert-base: targets for the hidden states
            labels = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
        out.append(((ids, mask, types), labels))
    return out


def loss_of(output, targets: torch.Tensor) -> torch.Tensor:
    if "logits" not in output:  # a base model: its hidden states and its pooler both get gradients
        return F.mse_loss(output.last_hidden_state, targets) + output.pooler_output.pow(2).mean()
    logits = output.logits
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())  # labels -100 are ignored


@cache
def reference(family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(family)
    optimizer = optimizer_of(model)
    losses = []
    for inputs, y in batches(family):
        optimizer.zero_grad()
        loss = loss_of(model(*inputs), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(family: str, tensor: int, data: int, sequence_parallel: bool):
    """10 steps on this rank's rows (``train_batch`` when the inputs are one tensor, else the
    engine's forward, backward and step: then every rank has the whole batch)."""
    ctx = layout(tensor, data, sequence_parallel)
    model = build(family)
    keys = list(model.state_dict())
    optimizer = optimizer_of(model)
    engine, *_ = tessera.initialize(model, optimizer, loss_of)
    per_rank = BATCH // data
    mine = slice(ctx.local_rank("data") * per_rank, (ctx.local_rank("data") + 1) * per_rank)
    losses = []
    for inputs, y in batches(family):
        if len(inputs) == 1:
            losses.append(float(engine.train_batch(iter([(inputs[0][mine], y[mine])]))))
            continue
        assert data == 1
        engine.zero_grad()
        loss = loss_of(engine(*inputs), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = full_state_dict(engine.model)
    split = {type(m).__name__ for m in model.modules() if type(m).__module__ == "tessera.hf.layers"}
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    facts = {"split": split, "optimizer_has_the_model": stepped == {id(p) for p in model.parameters()}}
    if family.startswith("bert") and hasattr(model, "cls"):
        head = model.cls.predictions
        facts["weight_tied"] = head.decoder.weight is model.bert.embeddings.word_embeddings.weight
        facts["bias_tied"] = head.bias is head.decoder.bias
    return losses, state, keys, facts


def check_against_reference(family: str, results) -> None:
    expected_losses, expected = reference(family)
    for losses, state, keys, facts in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **TOL)
        assert set(state) == set(keys) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, **TOL, msg=lambda m, key=key: key + m)
        assert facts["optimizer_has_the_model"]


@pytest.mark.parametrize("family", ["bert", "vit"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_encoder_trains_as_in_one_process(pools, family, layout):
    tensor, data, sp = LAYOUTS[layout]
    results = pools.run(tensor * data, train, family, tensor, data, sp, timeout=300)
    check_against_reference(family, results)
    for *_, facts in results:
        assert {"ColumnParallel", "RowParallel"} <= facts["split"]
        assert ("SequenceParallelNorm" in facts["split"]) == sp
        if family == "bert":  # the masked-LM decoder shares the word embedding's split, and its bias stays tied
            assert {"VocabEmbedding", "VocabHead"} <= facts["split"]
            assert facts["weight_tied"] and facts["bias_tied"]
        else:  # no word embedding; the classifier is left whole
            assert not {"VocabEmbedding", "VocabHead"} & facts["split"]


@pytest.mark.parametrize("family", ["bert-padded", "bert-classifier", "bert-token-classifier", "bert-base"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sequence-parallel"])
def test_bert_with_padding_token_types_and_its_other_heads_trains_as_in_one_process(pools, family, sequence_parallel):
    results = pools.run(2, train, family, 2, 1, sequence_parallel, timeout=300)
    check_against_reference(family, results)
    for *_, facts in results:
        assert {"ColumnParallel", "RowParallel", "VocabEmbedding"} <= facts["split"]
        assert ("VocabHead" in facts["split"]) == (family == "bert-padded")
        assert facts.get("bias_tied", True)


def refused_vit() -> str:
    layout(2, sequence_parallel=True)
    model = build("vit", image_size=4)  # 1 + 2 * 2 = 5 tokens
    try:
        tessera.initialize(model, optimizer_of(model), loss_of)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_a_vit_whose_sequence_the_tensor_size_does_not_divide_fails_at_initialize(pools):
    message = pools.run(2, refused_vit)[0]
    assert "ViTForImageClassification cannot be split this way" in message
    assert "the sequence (1 + patches per image) (5) must be divisible by the tensor size (2)" in message
