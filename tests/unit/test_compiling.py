"""Compiling in one process: the config switch, the C++ toolchain check, the blocks found, the
report of graphs and breaks, and a compiled model equal to eager (the multi-rank layouts are in
tests/dist/test_compile.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._inductor.config  # inductor reads CXX once, at import: before the tests set it
from torch import nn

import tessera
from tessera.compiling import CompileOptions, CompileReport, compile_blocks, find_blocks
from tessera.compiling.probe import probe_compile
from tessera.compiling.toolchain import check_toolchain, cpp_compiler
from tessera.config import load_config
from tessera.errors import ConfigError, ToolchainError
from tessera.models import NextTokenLoss, gpt
from tessera.testing import use_layout


def _tiny_gpt() -> nn.Module:
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)


def test_a_missing_cpp_compiler_is_one_clear_error_before_training(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/bin/g++")
    assert cpp_compiler() == "/nonexistent/bin/g++"
    use_layout(config={"compile": {"enabled": True}})
    model = _tiny_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ToolchainError) as caught:
        tessera.initialize(model, optimizer, NextTokenLoss())
    message = str(caught.value)
    # names what is missing, the fix, and the switches that run without a compiler
    assert "/nonexistent/bin/g++" in message and "apt-get install g++" in message and "CXX" in message
    assert "compile.enabled=false" in message and "aot_eager" in message
    assert "Traceback" not in message and "inductor/" not in message
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_toolchain_check_passes_here_and_ignores_backends_without_kernels(monkeypatch):
    check_toolchain("cpu", "inductor")  # this machine has g++ (the Makefile's CI image too)
    monkeypatch.setenv("CXX", "/nonexistent/bin/g++")
    check_toolchain("cpu", "aot_eager")  # builds no kernels: needs no compiler
    with pytest.raises(ToolchainError):
        check_toolchain("cpu", "inductor")


def test_the_compile_section_is_checked_at_load():
    config = load_config({"compile": {"enabled": True, "scope": "blocks", "backend": "aot_eager"}})
    assert config.compile.enabled and config.compile.backend == "aot_eager"
    with pytest.raises(ConfigError, match="compile.backend"):
        load_config({"compile": {"backend": "tvm"}})
    with pytest.raises(ConfigError, match="compile.scpoe"):
        load_config({"compile": {"scpoe": "blocks"}})
    with pytest.raises(ValueError, match="compile.scope"):
        CompileOptions(scope="layers")


def test_blocks_are_the_marked_ones_or_the_longest_list_of_one_class():
    assert [name for name, _ in find_blocks(_tiny_gpt())] == ["blocks.0", "blocks.1"]

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])  # two classes: not blocks
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    assert [name for name, _ in find_blocks(Plain())] == ["layers.0", "layers.1", "layers.2"]
    with pytest.raises(ConfigError, match="no blocks to compile"):
        compile_blocks(nn.Linear(2, 2), CompileOptions(), CompileReport())


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_a_compiled_gpt_trains_as_eager_and_reports_one_shared_graph(scope):
    eager = _tiny_gpt()
    compiled = copy.deepcopy(eager)
    report = CompileReport()
    torch._dynamo.reset()
    regions = compile_blocks(compiled, CompileOptions(scope=scope, backend="aot_eager"), report)
    assert regions == (["blocks.0", "blocks.1"] if scope == "blocks" else ["model"])
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    for model in (eager, compiled):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(3):
            optimizer.zero_grad()
            NextTokenLoss()(model(x), y).backward()
            optimizer.step()
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    stats = report.regions  # one graph, shared by the blocks (the position check does not break it)
    assert set(stats) == set(regions) and sum(s.graphs for s in stats.values()) == 1
    assert all(s.calls == 3 and not s.breaks and not s.eager for s in stats.values())
    assert report.as_dict()[regions[0]]["graphs"] == 1


class _TwoLayers(nn.Module):
    def __init__(self, inside: object) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.inside = inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        self.inside()  # type: ignore[operator]
        return self.layers[1](x)


def test_a_graph_break_is_reported_with_its_reason():
    report = CompileReport()
    torch._dynamo.reset()
    model = _TwoLayers(torch._dynamo.graph_break)
    compile_blocks(model, CompileOptions(scope="model", backend="eager"), report)
    model(torch.randn(2, 4))
    stats = report.regions["model"]
    assert stats.graphs == 2 and sum(stats.breaks.values()) == 1 and not stats.eager
    assert any("graph_break" in reason for reason in stats.breaks)
    assert "model: 2 graph(s), 1 graph break(s)" in report.lines()[0]


class _PrintsInALoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            print("", end="")  # a break inside a loop of the region's own frame: dynamo gives up on the frame
        return x


def test_a_region_that_falls_back_to_eager_says_so_once_naming_why():
    report = CompileReport()
    torch._dynamo.reset()
    model = _PrintsInALoop()
    compile_blocks(model, CompileOptions(scope="model", backend="eager"), report)
    with pytest.warns(
        UserWarning, match="compiled region model runs eagerly: Failed to trace builtin operator: .*`print`"
    ):
        model(torch.randn(2, 4))
    model(torch.randn(2, 4))  # said once
    assert report.regions["model"].eager and report.regions["model"].failures
    assert "eager (fell back)" in report.lines()[0]


def test_the_probe_compares_with_eager_and_times_a_cold_and_a_warm_compile():
    result = probe_compile(backend="aot_eager")  # tessera check --compile runs it with inductor
    assert result.max_diff < 1e-5
    assert result.cold_s > 0 and result.warm_s > 0
    assert set(result.report.regions) == {f"blocks.{i}" for i in range(4)}


def test_a_compiled_adamw_run_steps_with_the_fused_kernel_and_the_same_numbers():
    from tessera.optim.kernels import use_step_kernel
    from tessera.train import step_kernel

    assert step_kernel(load_config({"compile": {"enabled": True}})) == "fused"
    assert step_kernel(load_config({})) == "auto"  # eager runs keep torch's choice (and their numbers)
    assert step_kernel(load_config({"compile": {"enabled": True}, "optimizer": {"kernel": "foreach"}})) == "foreach"
    with pytest.raises(ConfigError, match="optimizer.kernel"):
        load_config({"optimizer": {"name": "sgd", "kernel": "fused"}})
    models = [_tiny_gpt() for _ in range(2)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3, foreach=False) for m in models]
    assert use_step_kernel(optimizers[1], "fused") == "fused"
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    for model, optimizer in zip(models, optimizers, strict=True):
        for _ in range(3):
            optimizer.zero_grad()
            NextTokenLoss()(model(x), y).backward()
            optimizer.step()
    # the key bias gets no true gradient (softmax ignores it), only rounding noise, which Adam scales
    # up: the kernels' different rounding moves it by ~2e-6, everything else by ~2e-8
    for (name, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="SGD takes optimizer.kernel='auto'"):
        use_step_kernel(torch.optim.SGD(models[0].parameters(), lr=0.1), "fused")
