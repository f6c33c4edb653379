"""The layers of the design, checked: each part of tessera imports only from the parts below it
(docs/architecture.md has the table), and no module takes part in an import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tessera"

# Rank of each part of the package: a part may import from parts of a lower rank (and from
# itself). Layers 1-6 of the design; inside layer 3 and 4 the order of its parts.
RANKS: dict[str, float] = {
    "errors": 0,
    "files": 0,  # atomic writes with the umask's mode
    "graph_breaks": 0,  # functions eager inside compiled code, disabled lazily
    "_lazy_dynamo": 0.5,  # dispatch modes marked with graph_breaks instead of torch's dynamo-importing wrapper
    "comm": 1,
    "context": 2,
    "memory": 3.0,
    "amp": 3.0,
    "optim": 3.0,
    "parallel": 3.1,  # strategies; parallel/strategy.py reads norms from optim
    "zero": 3.2,  # a strategy built on memory's chunk store and optim's norms
    "nn": 3.2,  # the user-facing layer factories over parallel/tensor
    "lora": 3.25,  # low-rank adapters beside frozen linear layers (their tensor-parallel splits, nn's MoE experts)
    "gemini": 3.3,  # the tiered residence of zero's sharded optimizer, over memory's tiers, policies and tracer
    "compiling": 3.4,  # regional torch.compile of a model's blocks, its report and the toolchain check
    "checkpoint": 4.0,
    "init": 4.05,  # deferred initialisation: fills what a strategy holds through checkpoint's placing
    "engine": 4.1,
    "models": 5.0,
    "hf": 5.0,  # policies that parallelize unmodified transformers models
    "data": 5.0,
    "planner": 5.05,  # the auto-parallel planner: cost models over model shapes, layout search
    "inference": 5.1,  # generation with a paged KV cache over models and hf
    "rlhf": 5.2,  # SFT, reward models, DPO, PPO and GRPO over the engine, models and inference
    "diffusion": 5.2,  # Stable Diffusion training on diffusers components: diffusers models built from configs, over nn's recompute
    "config": 6.0,  # builds the options of the layers below from a config
    "session": 6.1,  # the current run: context, config, tessera.initialize
    "job_env": 6.15,  # the world a launcher (torchrun, mpirun, srun) describes in the environment
    "launcher": 6.2,
    "__init__": 6.3,  # the public API (tessera.initialize, tessera.launch, ...)
    # applications of the public API
    "testing": 6.4,
    "serve": 6.45,  # the HTTP server and the rank group behind it (bench serve measures it)
    "train": 6.5,
    "rlhf_pipeline": 6.55,  # the stages of `tessera rlhf` over the public API, tessera.rlhf and train's optimizers
    "bench": 6.5,
    "cli": 6.6,
    "__main__": 6.7,
}


def part_of(module: str) -> str:
    """``tessera.zero.optimizer`` -> ``zero``; ``tessera`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    names = list(rel.parts)
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names)


def imports_of(path: Path, root: Path, modules: set[str]) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of a module of the package in ``path``: at the top,
    inside functions, and under ``if TYPE_CHECKING`` (an import for the type checker alone still
    ties the two modules: it counts for the ranks and for cycles alike). ``from a import b`` is
    module ``a.b`` when that is a module, else ``a``."""
    tree = ast.parse(path.read_text())
    package = root.name
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == package]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.append((node.lineno, full if full in modules else node.module))
    return found


def import_graph(root: Path) -> dict[str, list[tuple[int, str]]]:
    paths = sorted(root.rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    return {module_name(p, root): imports_of(p, root, modules) for p in paths}


def layer_violations(root: Path) -> list[str]:
    """Every import of a part of the same or a higher rank than the importing part's."""
    found = []
    for module, imports in import_graph(root).items():
        source = part_of(module)
        for line, target in imports:
            dest = part_of(target)
            if dest == source or dest not in RANKS or source not in RANKS:
                if source not in RANKS or dest not in RANKS:
                    found.append(f"{module}:{line}: {target} (a part missing from the layer table)")
                continue
            if RANKS[dest] >= RANKS[source]:
                found.append(f"{module}:{line}: imports {target} ({dest} is not below {source})")
    return found


def import_cycles(root: Path) -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph (Tarjan)."""
    graph = {m: sorted({t for _, t in imports if t != m}) for m, imports in import_graph(root).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_each_part_imports_only_from_the_parts_below_it():
    assert layer_violations(PACKAGE) == []


def test_no_import_cycles():
    assert import_cycles(PACKAGE) == []


def test_every_part_of_the_package_is_in_the_layer_table():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()}
    parts.discard("__pycache__")
    assert parts <= set(RANKS), sorted(parts - set(RANKS))


def _plant(root: Path, files: dict[str, str]) -> Path:
    package = root / "tessera"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_the_layer_check_catches_a_planted_upward_import(tmp_path):
    package = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "comm/__init__.py": "from tessera.comm.ops import x\n",
            "comm/ops.py": "def f():\n    from tessera.engine import Engine\n",  # lazy, still counted
            "engine/__init__.py": "from tessera.comm import x\n",
            # for the type checker alone, still counted
            "zero/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tessera.engine import E\n",
            "nn/__init__.py": "import tessera.zero\n",  # same rank: not allowed either
        },
    )
    assert layer_violations(package) == [
        "tessera.comm.ops:2: imports tessera.engine (engine is not below comm)",
        "tessera.nn:1: imports tessera.zero (zero is not below nn)",
        "tessera.zero:3: imports tessera.engine (engine is not below zero)",
    ]


def test_the_cycle_check_catches_a_planted_cycle(tmp_path):
    package = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/a.py": "from tessera.engine.b import g\n",
            "engine/b.py": "def g():\n    from tessera.engine import a\n",
            "engine/c.py": "from tessera.engine import a\n",
        },
    )
    assert import_cycles(package) == [["tessera.engine.a", "tessera.engine.b"]]


def test_the_cycle_check_catches_a_planted_cycle_through_type_checking_imports(tmp_path):
    package = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/loop.py": "from tessera.engine.hooks import Hook\n",
            "engine/hooks.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from tessera.engine.loop import Loop\n"  # names the loop in annotations only
            ),
            "engine/other.py": "import typing\nif typing.TYPE_CHECKING:\n    import tessera.engine.hooks\n",
        },
    )
    assert import_cycles(package) == [["tessera.engine.hooks", "tessera.engine.loop"]]
