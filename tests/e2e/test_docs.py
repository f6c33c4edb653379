"""The code in README.md and docs/getting-started.md runs as written.

Every fenced block is collected: a Python block is a file (its first line names it, ``# name.py``)
written into a scratch folder for its page; every line of a shell block is a command, run there
with bash, with the running environment's ``tessera`` first on PATH. A command that cannot run
here is listed in ``INSTEAD`` with the reason and the check that stands for it; a command run
shortened is listed in ``SHORTENED``. A block, a command or a file the tables do not account for
fails ``test_every_snippet_is_accounted_for``, and so does a table entry the pages lost.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/getting-started.md")
SHELL, PYTHON = {"bash", "sh", "shell"}, {"python", "py"}

# Commands run with extra arguments appended (the last --set of a key wins), and why.
SHORTENED: dict[str, tuple[str, str]] = {
    "tessera train --nproc-per-node 2 --set trainer.steps=100 --set optimizer.lr=1e-3": (
        "--set trainer.steps=2",
        "100 steps of the tiny GPT: 1-2 minutes on 2 cores (scaled from the 250-step run); 2 steps run the same path",
    ),
}


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    text: str


def blocks(page: str, text: str | None = None) -> list[Block]:
    """The fenced blocks of ``page`` (its text read from the repository unless given)."""
    text = (REPO / page).read_text() if text is None else text
    found = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        found.append(Block(page, text[: match.start()].count("\n") + 1, match.group(1), match.group(2)))
    return found


def commands(block: Block) -> list[str]:
    """The block's commands, one a line, comments dropped, normalised by shlex."""
    out = []
    for line in block.text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(shlex.join(words))
    return out


def file_name(block: Block) -> str | None:
    found = re.match(r"# ([\w.-]+\.py)\b", block.text)
    return found.group(1) if found else None


def files_of(page: str) -> dict[str, str]:
    return {file_name(b) or "": b.text for b in blocks(page) if b.lang in PYTHON}


def page_commands() -> list[tuple[str, str]]:
    return [(page, c) for page in PAGES for b in blocks(page) if b.lang in SHELL for c in commands(b)]


# ---- running a command the way a user would -------------------------------------------------


def tessera_bin(scratch: Path) -> Path:
    """The folder that holds this environment's ``tessera`` (a stand-in calling ``python -m
    tessera.cli`` where the package is not installed)."""
    here = Path(sys.executable).parent
    if (here / "tessera").exists():
        return here
    folder = scratch / "bin"
    folder.mkdir(exist_ok=True)
    stand_in = folder / "tessera"
    stand_in.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tessera.cli "$@"\n')
    stand_in.chmod(0o755)
    return folder


def user_env(scratch: Path) -> dict[str, str]:
    # No port is set here (no MASTER_PORT, no PET_* torchrun option): `tessera run` and `tessera
    # train` pick a free one (torchrun --standalone). A fixed PET_MASTER_PORT beside
    # --standalone made 1 run in 8 of my_train.py abort at exit here.
    outside = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MAKEFLAGS", "MAKELEVEL", "MFLAGS"}
    launched = outside | {k for k in os.environ if k.startswith("PET_")}
    env = {k: v for k, v in os.environ.items() if k not in launched}
    env["PATH"] = f"{tessera_bin(scratch)}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


@dataclass(frozen=True)
class Ran:
    out: subprocess.CompletedProcess
    folder: Path  # where it ran: relative paths it printed are under it


_RESULTS: dict[tuple[str, ...], Future[Ran]] = {}
_LOCK = threading.Lock()
_RUNNING = ThreadPoolExecutor(max_workers=4)


def start_in(page: str, command: str, scratch: Path) -> Future[Ran]:
    """Start ``command`` with bash in the page's scratch folder (its files written there), or find
    it started: the same command on the same files runs once (``tessera check`` is on both pages)."""
    files = files_of(page)
    key = (command, *sorted(f"{name}\n{text}" for name, text in files.items() if name and name in command))
    with _LOCK:
        if key not in _RESULTS:
            folder = scratch / page.replace("/", "_")
            folder.mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                if name:
                    (folder / name).write_text(text)

            def ran() -> Ran:
                out = subprocess.run(["bash", "-c", command], cwd=folder, env=user_env(scratch),
                                     capture_output=True, text=True, timeout=600)  # fmt: skip
                return Ran(out, folder)

            _RESULTS[key] = _RUNNING.submit(ran)
        return _RESULTS[key]


def run_in(page: str, command: str, scratch: Path) -> Ran:
    """:func:`start_in`, waited for."""
    return start_in(page, command, scratch).result()


# the pages' longest commands (4 ranks each, independent: their own run folders and ports), started
# together when this module's first test starts
LONGEST = [(p, c) for p in PAGES for b in blocks(p) if b.lang in SHELL for c in commands(b)
           if c.startswith("tessera run --nproc-per-node 4 ")]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _longest_started(tmp_path_factory):
    scratch = tmp_path_factory.getbasetemp() / "docs"
    scratch.mkdir(exist_ok=True)
    for page, command in LONGEST:
        start_in(page, as_run(command), scratch)


def as_run(command: str) -> str:
    """``command`` with the arguments SHORTENED appends to it."""
    return f"{command} {SHORTENED.get(command, ('', ''))[0]}".strip()


def make_dry_run(target: str) -> list[str]:
    """The recipe lines ``make <target>`` would run, setup included (``make -n -B``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "VENV", "PYTHON")}
    out = subprocess.run(["make", "-n", "-B", target], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


# ---- what each command must leave behind, beyond exiting with 0 -------------------------------


RUN_FOLDER = ("config.json", "loss.png", "metrics.jsonl", "model.safetensors")
TRAINER_FOLDER = ("metrics.jsonl", "model.safetensors", "step_16", "step_32", "step_48")


def ran_a_training(ran: Ran) -> None:
    out = ran.out
    wrote = re.search(r"wrote (\S+)", out.stderr)
    assert wrote, out.stderr
    run_dir = ran.folder / wrote.group(1)
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(RUN_FOLDER)
    assert "\r" not in out.stderr, "stderr is a pipe here: no progress bar, only the metric lines"


def printed_three_epochs(ran: Ran) -> None:
    printed = [line.split()[0] for line in ran.out.stdout.splitlines() if line[:1].isdigit()]
    assert printed == ["0", "1", "2"], ran.out.stdout


def wrote_the_trainers_checkpoints(ran: Ran) -> None:
    mine = ran.folder / "runs" / "mine"
    assert sorted(p.name for p in mine.iterdir()) == sorted(TRAINER_FOLDER)
    steps = [json.loads(line) for line in (mine / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "final" not in m] == list(range(1, 49))
    assert "eval_loss" in steps[15] and "peak_rss_bytes" in steps[9]


def checked_the_installation(ran: Ran) -> None:
    out = ran.out
    assert "torch       2." in out.stdout
    assert "gloo" in out.stdout
    assert re.search(r"peak        cpu rank: [\d.]+ GFLOP/s fp32 \(.*, 1 thread; (measured|cached)\)", out.stdout)
    assert "all-reduce  2 ranks (gloo): ok" in out.stdout


AFTER: dict[tuple[str, str], Callable[[Ran], None]] = {
    ("docs/getting-started.md", "tessera run --nproc-per-node 4 my_train.py"): printed_three_epochs,
    ("docs/getting-started.md", "tessera run --nproc-per-node 4 my_trainer.py"): wrote_the_trainers_checkpoints,
    ("README.md", "tessera check"): checked_the_installation,
    ("docs/getting-started.md", "tessera check"): checked_the_installation,
}


# ---- commands that cannot run inside the suite, and what is checked instead --------------------


def instead_of_make_setup(scratch: Path) -> None:
    recipe = make_dry_run("setup")
    assert recipe[0] == "python3 -m venv .venv", recipe
    torch_at = recipe.index(".venv/bin/python -m pip install --quiet torch==2.13.0")
    assert recipe.index(".venv/bin/python -m pip install --quiet -e '.[test]'") > torch_at, "torch first"


def instead_of_activate(scratch: Path) -> None:
    assert "python3 -m venv .venv" in make_dry_run("setup"), "make setup makes the .venv that is activated"
    env = user_env(scratch)
    found = subprocess.run(["bash", "-c", "command -v tessera"], env=env, capture_output=True, text=True)
    assert found.stdout.strip() == str(tessera_bin(scratch) / "tessera"), "commands here use this environment's"


README_TRAIN = "tessera train --nproc-per-node 2 --set trainer.steps=100 --set optimizer.lr=1e-3"


def instead_of_make_train(scratch: Path) -> None:
    assert make_dry_run("train")[-1] == ".venv/bin/tessera train"
    ran = run_in("README.md", as_run(README_TRAIN), scratch)  # the README's command's run
    assert ran.out.returncode == 0, ran.out.stdout + ran.out.stderr
    ran_a_training(ran)


def instead_of_make_test(scratch: Path) -> None:
    ci = commands(Block(".ci/run", 1, "bash", (REPO / ".ci" / "run").read_text()))
    assert [c for c in ci if not c.startswith(("set ", "cd "))] == ["make test"], ci
    recipe = make_dry_run("test")
    text = "\n".join(recipe)
    for step in ("ruff check tessera tests examples", "ruff format --check tessera tests examples", "mypy"):
        assert f".venv/bin/{step}" in text, recipe  # the lint, beside pytest
    [pytest_line] = [line for line in recipe if ".venv/bin/python -m pytest" in line]
    args = pytest_line.split("-m pytest", 1)[1].split(";")[0].split()
    folders = {p.name for p in (REPO / "tests").iterdir() if p.name != "cuda" and any(p.glob("test_*.py"))}
    assert args[0] == "-q" and {a.removeprefix("tests/") for a in args[1:]} == folders, "the whole suite: no -k"


def instead_of_bench_dp(scratch: Path) -> None:
    from tessera.cli import BENCH_TARGETS, build_parser

    args = build_parser().parse_args(["bench", "dp", "--out", "dp.json"])
    assert (args.target, args.out) == ("dp", "dp.json")
    readme_line = next(line for line in (REPO / "README.md").read_text().splitlines() if "tessera bench dp" in line)
    named = set(re.findall(r"[\w-]+", readme_line))
    assert set(BENCH_TARGETS) <= named, f"README's bench line leaves out {sorted(set(BENCH_TARGETS) - named)}"


INSTEAD: dict[str, tuple[str, Callable[[Path], None]]] = {
    "make setup": (
        "downloads and installs torch and tessera into .venv (minutes, network); the suite already "
        "runs in such an environment. Checked: `make -n -B setup` makes .venv, installs torch==2.13.0, "
        "then tessera[test]",
        instead_of_make_setup,
    ),
    "source .venv/bin/activate": (
        "changes the calling shell only; here every command finds this environment's `tessera` "
        "first on PATH, which is what activating does. Checked: that, and that make setup makes .venv",
        instead_of_activate,
    ),
    "make train": (
        "250 steps on 4 ranks: 5 min 20 s measured on the 2-core test machine under load (about "
        "2.5 min idle), and make would build its own .venv. Checked: `make -n -B train` ends with "
        "`.venv/bin/tessera train`, and `tessera train` writes the run folder (the run of the "
        "README's `tessera train` command, shortened, looked at again; the default run on 4 "
        "processes is tests/e2e/test_golden_train.py's)",
        instead_of_make_train,
    ),
    "make test": (
        "it is this suite. Checked: .ci/run runs exactly `make test`, which runs ruff, mypy and "
        "`pytest -q` over the whole suite",
        instead_of_make_test,
    ),
    "tessera bench dp --out dp.json": (
        "1 min 54 s measured (24 timed blocks of 3 steps per side on 4 ranks); "
        "tests/e2e/test_bench.py runs the same benchmark at tiny sizes. Checked: the command line "
        "parses to the dp benchmark writing dp.json, and the README names every benchmark",
        instead_of_bench_dp,
    ),
}


# ---- the tests ----------------------------------------------------------------------------------


def unaccounted(pages: dict[str, str]) -> list[str]:
    """What in ``pages`` (name -> text) the test would not run or check, and the table entries
    that no page has any more."""
    found = []
    page_blocks = {page: blocks(page, text) for page, text in pages.items()}
    listed = {c for bs in page_blocks.values() for b in bs if b.lang in SHELL for c in commands(b)}
    for page, bs in page_blocks.items():
        on_page = [c for b in bs if b.lang in SHELL for c in commands(b)]
        files = {file_name(b): b.text for b in bs if b.lang in PYTHON}
        for block in bs:
            where = f"{page}:{block.line}"
            if block.lang not in SHELL | PYTHON:
                found.append(f"{where}: a ```{block.lang} block; give it bash or python")
            elif block.lang in PYTHON:
                name = file_name(block)
                if name is None:
                    found.append(f"{where}: a Python block must start with `# name.py` to be run")
                elif not any(name in c for c in on_page) and not any(
                    n != name and f'"{name}"' in text for n, text in files.items()
                ):
                    found.append(f"{where}: no command on the page runs or loads {name}")
    for table, entries in (("INSTEAD", INSTEAD), ("SHORTENED", SHORTENED)):
        found += [f"{table} names a command no page has: {c}" for c in sorted(set(entries) - listed)]
    return found


def test_every_snippet_is_accounted_for():
    assert unaccounted({page: (REPO / page).read_text() for page in PAGES}) == []
    assert not set(INSTEAD) & set(SHORTENED)


def test_the_accounting_catches_what_it_would_not_run():
    planted = "```console\n$ tessera check\n```\n\n```python\nprint(1)\n```\n\n```python\n# lonely.py\n```\n"
    problems = unaccounted({"page.md": planted})
    assert problems[:3] == [
        "page.md:1: a ```console block; give it bash or python",
        "page.md:5: a Python block must start with `# name.py` to be run",
        "page.md:9: no command on the page runs or loads lonely.py",
    ]
    assert len(problems) == 3 + len(INSTEAD) + len(SHORTENED), "every table entry is stale on this page"


@pytest.mark.parametrize(("page", "command"), page_commands(), ids=[f"{p}: {c}" for p, c in page_commands()])
def test_the_command_runs_as_written(page, command, tmp_path_factory):
    scratch = tmp_path_factory.getbasetemp() / "docs"
    scratch.mkdir(exist_ok=True)
    if command in INSTEAD:
        INSTEAD[command][1](scratch)
        return
    ran = run_in(page, as_run(command), scratch)
    assert ran.out.returncode == 0, f"{command}\n{ran.out.stdout}\n{ran.out.stderr}"
    assert "Traceback" not in ran.out.stderr, ran.out.stderr
    if command.startswith("tessera train"):
        ran_a_training(ran)
    if (page, command) in AFTER:
        AFTER[(page, command)](ran)


def _without_where_the_config_comes_from(source: str) -> str:
    """The module's code with its docstring, ``import sys`` and launch_from_torch's arguments
    taken out (the example takes its config path from the command line)."""
    tree = ast.parse(source)
    body = [
        node
        for node in tree.body
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        and not (isinstance(node, ast.Import) and [a.name for a in node.names] == ["sys"])
    ]
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "tessera.launch_from_torch":
            node.args = []
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def test_the_examples_folder_holds_the_getting_started_code():
    """examples/my_train.py (run by tests/e2e/test_train.py) is the page's my_train.py but for
    where it finds its config; examples/my_config.py is the page's."""
    page = files_of("docs/getting-started.md")
    example = (REPO / "examples" / "my_train.py").read_text()
    assert _without_where_the_config_comes_from(example) == _without_where_the_config_comes_from(page["my_train.py"])
    config = (REPO / "examples" / "my_config.py").read_text()
    assert ast.dump(ast.parse(config)) == ast.dump(ast.parse(page["my_config.py"]))


def test_relative_links_point_at_files_in_the_repository():
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"\w+://", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert broken == []
