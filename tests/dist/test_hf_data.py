"""Hugging Face data as it comes: dict batches from a data collator (padding, attention masks,
labels with -100 for padding and for a masked prompt), read from an iterable dataset or through
a custom batch sampler, trained by ``Trainer.fit`` on unmodified transformers models.

Under data parallelism and gradient accumulation the losses, the evaluation loss and the weights
match plain single-process transformers on the same data (fp32, 1e-5): the engine weighs each
micro-batch by the labels its loss counts, so the ranks' different numbers of ignored labels do
not matter. The stream's uneven end stops every rank at the same step (no hang), and a stream's
position resumes from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models
from torch.utils.data import DataLoader, IterableDataset

import tessera
from tessera.checkpoint import CheckpointError, full_state_dict
from tessera.engine import EvalHook, ThroughputHook
from tessera.errors import TesseraError
from tessera.testing import tolerance, use_layout, within

SEQ, VOCAB = 14, 40
PAD = 0


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the words "0" ... "39" (no download); "0" pads."""
    words = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="1"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token=str(PAD))


class Sequences(IterableDataset):
    """``n`` token sequences of 3 to ``SEQ`` tokens, the same on every rank and in the reference."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed = n, seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(self.n):
            length = int(torch.randint(3, SEQ + 1, (1,), generator=g))
            yield {"input_ids": torch.randint(1, VOCAB, (length,), generator=g).tolist()}


class Collate:
    """``DataCollatorForLanguageModeling(mlm=False)`` (right padding, labels -100 on padding), and
    a prompt of 0-2 tokens per row whose labels are -100 too."""

    def __init__(self) -> None:
        self.collator = transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False)

    def __call__(self, features):
        batch = self.collator(features)
        for row, ids in enumerate(batch["input_ids"]):
            batch["labels"][row, : int(ids[0]) % 3] = -100
        return batch


def build(family: str) -> torch.nn.Module:
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)  # eps: see test_hf_tensor.py


def plain_training(family: str, batches) -> tuple[list[float], dict[str, torch.Tensor], torch.nn.Module]:
    """Single-process transformers: one step per batch, ``model(**batch).loss``."""
    model = build(family)
    optimizer = optimizer_of(model)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, model


@torch.no_grad()
def plain_eval_loss(model: torch.nn.Module, items: list[dict]) -> float:
    model.eval()
    return model(**Collate()(items)).loss.item()


def assert_same_training(got, losses, state):
    got_losses, got_state = got
    tol = tolerance(blocks=2, steps=len(losses))  # build(): 2 layers, a step per loss
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), **tol)
    assert got_state.keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(got_state[key], value, **tol, msg=lambda m, key=key: key + m)


# ---- an iterable dataset under data parallelism and accumulation ----------------------------------

EVAL_ITEMS = 12


def fit_stream(family: str, data: int, accumulation: int, rows: int, items: int):
    use_layout(data=data, config={"parallel": {"data": data}, "gradient_accumulation": accumulation})
    model = build(family)
    train = DataLoader(Sequences(items), batch_size=rows, collate_fn=Collate())
    test = DataLoader(Sequences(EVAL_ITEMS, seed=9), batch_size=rows, collate_fn=Collate())
    engine, train, test, _ = tessera.initialize(model, optimizer_of(model), None, train, test)
    history = tessera.Trainer(engine, [EvalHook(test)]).fit(train, epochs=1)
    losses = [m["loss"] for m in history]
    return losses, full_state_dict(engine.model), history[-1]["eval_loss"]


# name: (family, data ranks, accumulation, rows per rank's micro-batch, items in the stream); the
# stream's last micro-step batch is short (4 or 3 rows), the global batch data x accumulation x rows
STREAMS = {
    "gpt2-dp2": ("gpt2", 2, 1, 3, 34),
    "gpt2-dp2-accumulation2": ("gpt2", 2, 2, 2, 31),
    "gpt2-one-process-accumulation2": ("gpt2", 1, 2, 4, 31),
    "llama-dp2-accumulation2": ("llama", 2, 2, 2, 31),
}


@pytest.mark.parametrize("case", list(STREAMS))
def test_a_stream_of_dict_batches_trains_as_plain_transformers(pools, case):
    family, data, accumulation, rows, items = STREAMS[case]
    reference = DataLoader(Sequences(items), batch_size=data * accumulation * rows, collate_fn=Collate())
    losses, state, model = plain_training(family, reference)
    eval_loss = plain_eval_loss(model, list(Sequences(EVAL_ITEMS, seed=9)))
    args = (family, data, accumulation, rows, items)
    results = pools.run(data, fit_stream, *args, timeout=300) if data > 1 else [fit_stream(*args)]
    assert len(losses) == 6 if accumulation == 1 else len(losses) == 4
    for got_losses, got_state, got_eval in results:
        assert_same_training((got_losses, got_state), losses, state)
        assert within(got_eval, eval_loss, blocks=2, steps=len(losses)), (got_eval, eval_loss)


def test_a_micro_batch_without_labels_adds_nothing_and_a_step_without_any_raises():
    use_layout(config={"gradient_accumulation": 2})
    collate = Collate()
    items = list(Sequences(8))
    counted, ignored = collate(items[:4]), collate(items[4:])
    ignored["labels"][:] = -100
    losses, state, _ = plain_training("gpt2", [counted, counted])
    model = build("gpt2")
    engine, *_ = tessera.initialize(model, optimizer_of(model))
    got = [engine.train_batch(iter([counted, ignored])) for _ in range(2)]
    assert_same_training((got, full_state_dict(engine.model)), losses, state)
    with pytest.raises(TesseraError, match="no item for its loss to average over"):
        engine.train_batch(iter([ignored, ignored]))


# ---- a custom batch sampler ------------------------------------------------------------------------

BUCKETS = [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20], [21, 22]]


class Buckets:
    """Batches of different sizes (as a length-bucketing sampler gives), the same on every rank."""

    def __iter__(self):
        return iter(BUCKETS)

    def __len__(self) -> int:
        return len(BUCKETS)


def fit_batch_sampler():
    ctx = use_layout(data=2, config={"parallel": {"data": 2}})
    model = build("gpt2")
    items = list(Sequences(23))
    loader = DataLoader(items, batch_sampler=Buckets(), collate_fn=Collate())
    engine, loader, _, _ = tessera.initialize(model, optimizer_of(model), None, loader)
    seen = [batch["input_ids"][:, 0].tolist() for batch in loader]
    history = tessera.Trainer(engine, [ThroughputHook()]).fit(loader, epochs=1)
    assert all(m["samples_per_s"] > 0 for m in history)  # counted from the rows: the loader has no batch_size
    return ctx.rank, seen, ([m["loss"] for m in history], full_state_dict(engine.model))


def test_a_custom_batch_sampler_is_shared_batch_by_batch(pools):
    items = list(Sequences(23))
    collate = Collate()
    # rank r takes batches r, r + 2, ...; the seventh batch, without a partner, is left out
    steps = [collate([items[i] for i in BUCKETS[k] + BUCKETS[k + 1]]) for k in (0, 2, 4)]
    losses, state, _ = plain_training("gpt2", steps)
    for rank, seen, got in pools.run(2, fit_batch_sampler, timeout=300):
        assert seen == [[items[i]["input_ids"][0] for i in BUCKETS[k]] for k in range(rank, 6, 2)]
        assert_same_training(got, losses, state)


# ---- the uneven end, a resumed stream, refusals ---------------------------------------------------


def uneven_end():
    ctx = use_layout(data=2, config={"parallel": {"data": 2}, "gradient_accumulation": 2})
    model = build("gpt2")
    # 21 items in batches of 2 x 2 rows: 5 whole ones and 1 row, too few to share (left out); the
    # fifth micro-batch cannot fill a step of 2
    loader = DataLoader(Sequences(21), batch_size=2, collate_fn=Collate())
    engine, loader, _, _ = tessera.initialize(model, optimizer_of(model), None, loader)
    data_iter = iter(loader)
    engine.train_batch(data_iter), engine.train_batch(data_iter)
    try:
        engine.train_batch(data_iter)
        ended = False
    except StopIteration:
        ended = True
    together = engine.mean_over_data(float(ctx.rank))  # a collective after the end: every rank is here
    history = tessera.Trainer(engine).fit(loader, steps=5)  # two steps an epoch: three epochs
    return ended, engine.micro_step, together, [(m["step"], m["epoch"]) for m in history]


def test_the_uneven_end_of_a_stream_stops_every_rank_together(pools):
    for ended, micro_step, together, steps in pools.run(2, uneven_end, timeout=120):
        assert ended and micro_step == 0 and together == 0.5
        assert steps == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2)]


def resumed_stream(folder: str, resume: bool):
    use_layout(data=2, config={"parallel": {"data": 2}})
    model = build("gpt2")
    loader = DataLoader(Sequences(26), batch_size=2, collate_fn=Collate())  # 7 steps an epoch (the last 2 rows)
    engine, loader, _, _ = tessera.initialize(model, optimizer_of(model), None, loader)
    trainer = tessera.Trainer(
        engine,
        checkpoint_dir=folder,
        checkpoint_every=3,
        resume=str(Path(folder) / "step-00000006") if resume else None,
    )
    history = trainer.fit(loader, steps=10)
    return [m["loss"] for m in history], full_state_dict(engine.model), loader.state_dict()


def test_a_stream_resumes_from_a_checkpoint(pools, tmp_path):
    whole = pools.run(2, resumed_stream, str(tmp_path), False, timeout=300)
    again = pools.run(2, resumed_stream, str(tmp_path), True, timeout=300)
    for (losses, state, position), (resumed, resumed_state, resumed_position) in zip(whole, again, strict=True):
        assert len(losses) == 10 and resumed == losses[6:]  # steps 7-10: the rest of epoch 0, 3 steps of epoch 1
        assert position == resumed_position == {"kind": "stream", "epoch": 1, "batches": 3, "batch_size": 4}
        for key, value in state.items():
            assert torch.equal(resumed_state[key], value), key


def refusals(folder: str):
    use_layout(config={})
    model = build("gpt2")
    engine, *_ = tessera.initialize(model, optimizer_of(model))
    loader = DataLoader(list(Sequences(8)), batch_size=2, collate_fn=Collate())  # not initialize's: no position
    try:
        tessera.Trainer(engine, checkpoint_dir=folder, checkpoint_every=1).fit(loader, steps=1)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_checkpointing_a_loader_that_cannot_say_where_it_is_is_refused(tmp_path):
    message = refusals(str(tmp_path))
    assert message is not None and "cannot say where it is in its epoch" in message and "tessera.initialize" in message
