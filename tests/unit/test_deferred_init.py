"""tessera.deferred_init(): a model recorded on the meta device and made by initialize has the
values (and leaves the random state) of a normal build; what cannot be replayed is refused
with a way out; other sources of values (init_fn, safetensors files, checkpoints) fill it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tessera
from tessera.checkpoint import full_state_dict, save, save_weights
from tessera.init import DeferredInitError, deferred_init
from tessera.init.replay import replay
from tessera.models import gpt
from tessera.testing import use_layout


class Mixed(nn.Module):
    """Layers' own inits, then a model init that redraws some, partial in-place edits, a seed
    set inside construction, an explicit generator, buffers and a tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a = nn.Linear(8, 6)
        self.e = nn.Embedding(5, 8, padding_idx=1)
        self.n = nn.LayerNorm(6)
        self.b = nn.Linear(6, 6)
        self.q = nn.Linear(6, 6, bias=False)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)
        self.register_buffer("scale", torch.full((6,), 0.5))
        self.freqs = torch.arange(6) * 0.1  # a plain attribute
        nn.init.trunc_normal_(self.b.weight, std=0.02)  # data-dependent: replayed as one call
        nn.init.orthogonal_(self.q.weight)
        g = torch.Generator().manual_seed(11)
        nn.init.normal_(self.a.bias, generator=g)
        with torch.no_grad():
            self.a.weight[:, :2].mul_(2)
            self.e.weight[3].zero_()


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update(dict(model.named_buffers()))
    out["freqs"] = model.freqs
    return out


def _initialize(model: nn.Module, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return tessera.initialize(model, optimizer, **kwargs)[0]


def test_replayed_values_and_random_state_are_those_of_a_normal_build():
    use_layout(config={})
    torch.manual_seed(0)
    normal = Mixed()
    after_normal = torch.rand(4)
    torch.manual_seed(0)
    with deferred_init():
        model = Mixed()
    assert all(t.is_meta for t in _tensors(model).values())
    _initialize(model)
    after = torch.rand(4)
    for key, value in _tensors(normal).items():
        got = _tensors(model)[key]
        assert not got.is_meta and torch.equal(got, value), key
    assert torch.equal(after, after_normal), "the random stream continues where a normal build leaves it"


def test_draws_between_construction_and_initialize_keep_their_place():
    use_layout(config={})
    with deferred_init():
        model = Mixed()
    drawn = torch.rand(3)  # after the block: from the seed set inside construction
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))
    before = torch.get_rng_state()
    _initialize(model)
    assert torch.equal(torch.get_rng_state(), before), "the user's own draws are not replaced by the replay's"


def test_replay_holds_about_one_full_tensor_at_a_time():
    torch.manual_seed(0)
    with deferred_init() as rec:
        model = gpt("tiny", vocab_size=512, d_model=64, n_layers=3, n_heads=4)
    params = dict(model.named_parameters())
    largest = max(p.numel() * p.element_size() for p in params.values())
    total = sum(p.numel() * p.element_size() for p in params.values())
    targets = {rec.sid_of(p) for p in params.values()}
    stats: dict[str, int] = {}
    for _ in replay(rec, {t for t in targets if t is not None}, stats=stats):
        pass
    assert stats["peak_bytes"] <= 2 * largest < total / 2, (stats, largest, total)


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4)
        if self.w.weight.abs().max().item() > 10:  # reads a value while it is built
            raise AssertionError("never")


def test_a_model_that_reads_values_while_built_is_refused_with_a_way_out():
    use_layout(config={})
    with deferred_init():
        model = ReadsValues()
    with pytest.raises(DeferredInitError, match=r"reads tensor values.*init=fn") as info:
        _initialize(model)
    assert "test_deferred_init.py" in str(info.value), "the message says where the read happened"

    def init_fn(name, shape, dtype):
        return torch.full(shape, 0.25 if name.endswith("weight") else -1.0, dtype=dtype)

    with deferred_init():
        model = ReadsValues()
    _initialize(model, init=init_fn)
    assert torch.equal(model.w.weight, torch.full((4, 4), 0.25))
    assert torch.equal(model.w.bias, torch.full((4,), -1.0))


def test_init_fn_returning_a_wrong_shape_names_the_tensor():
    use_layout(config={})
    with deferred_init():
        model = nn.Linear(3, 2)
    with pytest.raises(DeferredInitError, match=r"init_fn\('weight', \(2, 3\)"):
        _initialize(model, init=lambda name, shape, dtype: torch.zeros(3))


def test_meta_tensors_not_from_deferred_init_are_refused():
    use_layout(config={})
    model = nn.Linear(3, 2, device="meta")
    with pytest.raises(DeferredInitError, match="deferred_init"):
        _initialize(model)


def test_gradient_hooks_registered_while_deferred_run_once_the_parameters_are_made():
    """A hook put on a meta parameter (the grid modes' all-reduce of a replicated table's
    gradient) runs on the real parameter initialize makes; its handle still removes it."""
    use_layout(config={})
    with deferred_init():
        model = nn.Linear(3, 2)
    model.weight.register_hook(lambda grad: grad * 2)
    accumulated: list[torch.Tensor] = []
    handle = model.bias.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.clone()))
    engine = _initialize(model)
    x = torch.ones(4, 3)
    engine(x).sum().backward()
    assert not model.weight.is_meta and torch.equal(model.weight.grad, torch.full((2, 3), 8.0))
    assert len(accumulated) == 1 and torch.equal(accumulated[0], torch.full((2,), 4.0))
    handle.remove()
    model.bias.grad = None
    engine(x).sum().backward()
    assert len(accumulated) == 1


def _tiny_gpt():
    return gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)


def test_a_safetensors_file_and_a_checkpoint_fill_a_deferred_model(tmp_path):
    use_layout(config={})
    torch.manual_seed(1)
    source = _tiny_gpt()
    expected = {k: v.clone() for k, v in source.state_dict().items()}
    save_weights(full_state_dict(source), tmp_path / "full.safetensors")
    engine = _initialize(source)
    save(tmp_path / "ckpt", engine)
    for init in (tmp_path / "full.safetensors", str(tmp_path / "ckpt")):
        torch.manual_seed(2)  # another seed: the values come from the file
        with deferred_init():
            model = _tiny_gpt()
        _initialize(model, init=init)
        for key, value in model.state_dict().items():
            assert torch.equal(value, expected[key]), (init, key)
    normal = _tiny_gpt()  # built normally: init= loads it too
    _initialize(normal, init=tmp_path / "full.safetensors")
    assert all(torch.equal(v, expected[k]) for k, v in normal.state_dict().items())


def test_a_file_missing_a_tensor_names_it(tmp_path):
    use_layout(config={})
    save_weights({"weight": torch.zeros(2, 3)}, tmp_path / "part.safetensors")
    with deferred_init():
        model = nn.Linear(3, 2)
    with pytest.raises(DeferredInitError, match="no values for bias"):
        _initialize(model, init=tmp_path / "part.safetensors")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 4096 + 3, 4096 + 20, 2 * 4096 + 16, 3 * 4096])
def test_drawing_in_chunks_gives_the_values_of_one_draw(dtype, n):
    """What the replay relies on to make only a rank's range of a drawn tensor (and to draw a
    ``randn`` / ``rand`` piece by piece into reused memory)."""
    from tessera.init.replay import chunks

    assert all(b - a <= 4096 + 15 for a, b in chunks(n, size=4096))
    for draw in (lambda t: t.normal_(0.1, 0.02), lambda t: t.uniform_(-0.3, 0.3)):
        torch.manual_seed(3)
        whole = draw(torch.empty(n, dtype=dtype))
        after_whole = torch.rand(2)
        torch.manual_seed(3)
        pieces = torch.empty(n, dtype=dtype)
        for a, b in chunks(n, size=4096):
            draw(pieces[a:b])
        assert torch.equal(pieces, whole) and torch.equal(torch.rand(2), after_whole)
    for made, in_place in ((torch.randn, lambda t: t.normal_(0.0, 1.0)), (torch.rand, lambda t: t.uniform_(0.0, 1.0))):
        torch.manual_seed(4)
        whole = made(n, dtype=dtype)
        torch.manual_seed(4)
        pieces = torch.empty(n, dtype=dtype)
        for a, b in chunks(n, size=4096):
            in_place(pieces[a:b])
        assert torch.equal(pieces, whole)


def test_a_rank_range_of_a_drawn_tensor_is_made_alone():
    """A window of a GPT weight: bitwise the whole replay's values over that range, without the
    whole tensor ever being made."""
    torch.manual_seed(0)
    with deferred_init() as rec:
        model = gpt("tiny", vocab_size=512, d_model=64, n_layers=2, n_heads=4)
    weight = model.blocks[0].mlp.fc.weight
    sid = rec.sid_of(weight)
    whole = next(m for m in replay(rec, {sid}) if m.sid == sid)
    expected = torch.empty(0).set_(whole.storage, 0, weight.shape, weight.stride()).reshape(-1)[1000:5000].clone()
    stats: dict[str, int] = {}
    made = next(m for m in replay(rec, {sid}, windows={sid: (1000, 5000)}, stats=stats) if m.sid == sid)
    assert made.window is not None and made.start == 1000
    assert torch.equal(made.window, expected)
    assert stats["peak_bytes"] < weight.numel() * 4
