"""Jobs started by a real OpenMPI ``mpirun`` and a real Slurm (``srun``, ``sbatch``), on two hosts
made of network namespaces (``tessera.testing.hosts``) with 2 ranks on each: ``mpirun`` reaches
the second host through the hosts' launch agent, and Slurm is a ``slurmctld`` and one ``slurmd``
per host (``tessera.testing.slurm``), started once for the module. The recipes of
docs/launch.md's Slurm and OpenMPI sections run as written there, with the getting-started
script, and print the losses that ``tessera run --nproc-per-node 4`` prints for it;
tests/e2e/scripts/launched_train.py under ``srun`` trains to the single-process answer (fp32,
losses and weights within 1e-5 relative).

These tests need root (network namespaces) and the system packages the Makefile's setup installs
as root (``make setup``; .ci/system-packages); without them they fail, naming what to do."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tessera.testing import hosts as nshosts
from tessera.testing.slurm import SlurmCluster
from tests.e2e.test_docs import SHELL, Block, blocks, commands, files_of, run_in, user_env

REPO = Path(__file__).resolve().parents[2]
LAUNCH_DOC = "docs/launch.md"
SCRIPT = REPO / "tests" / "e2e" / "scripts" / "launched_train.py"
TIMEOUT = 180
GETTING_STARTED = "docs/getting-started.md"


def needed() -> str | None:
    """Why these tests cannot run here, or None."""
    why = nshosts.available()
    if why is not None:
        return f"namespace hosts cannot be made here: {why}"
    return nshosts.missing_tools(list(nshosts.SYSTEM_PACKAGES))


@pytest.fixture(scope="module")
def hosts():
    why = needed()
    if why is not None:
        pytest.fail(why, pytrace=False)
    with nshosts.Hosts(2) as made:
        yield made


@pytest.fixture(scope="module")
def slurm(hosts, tmp_path_factory):
    with SlurmCluster(hosts, tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A folder with the getting-started page's my_train.py and my_config.py, where the recipes run."""
    folder = tmp_path_factory.mktemp("launch")
    for name, text in files_of(GETTING_STARTED).items():
        if name:
            (folder / name).write_text(text)
    return folder


def job_env(scratch: Path) -> dict[str, str]:
    """A user's environment: no launcher's variables, this environment's python and tessera first."""
    launched = ("OMPI_", "PMIX_", "SLURM_")
    return {k: v for k, v in user_env(scratch).items() if not k.startswith(launched)}


def mpirun_env(scratch: Path, agent: Path) -> dict[str, str]:
    """What ``mpirun`` needs here and a cluster's configuration would hold: root may run it, the
    hosts' agent instead of ssh, 4 ranks on 2 cores, and the map of ranks to hosts printed."""
    return {**job_env(scratch), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_plm_rsh_agent": str(agent), "OMPI_MCA_rmaps_base_oversubscribe": "1",
            "OMPI_MCA_rmaps_base_display_map": "1"}  # fmt: skip


def epoch_losses(text: str) -> list[float]:
    """What my_train.py prints on rank 0: ``EPOCH LOSS`` once an epoch."""
    found = [(int(m.group(1)), float(m.group(2))) for m in re.finditer(r"^(\d+) (\S+)$", text, re.M)]
    assert [epoch for epoch, _ in found] == [0, 1, 2], text
    return [loss for _, loss in found]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """my_train.py's losses on 4 ranks under torchrun, on this host (the runs below must print
    these): the getting-started page's own command, which tests/e2e/test_docs.py runs on the same
    files (run once in the session, whichever test asks first)."""
    ran = run_in(GETTING_STARTED, "tessera run --nproc-per-node 4 my_train.py", tmp_path_factory.getbasetemp() / "docs")
    assert ran.out.returncode == 0, ran.out.stdout + ran.out.stderr
    return epoch_losses(ran.out.stdout)


# ---- the recipes of docs/launch.md ----------------------------------------------------------------


def section(title: str) -> list[Block]:
    """The fenced blocks under docs/launch.md's ``## {title}``."""
    text = (REPO / LAUNCH_DOC).read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return blocks(LAUNCH_DOC, text[start : end if end >= 0 else None])


def shell_commands(title: str) -> list[str]:
    return [c for b in section(title) if b.lang in SHELL and not b.text.startswith("#!") for c in commands(b)]


def batch_script() -> tuple[str, str]:
    """The Slurm section's batch script: its file name (from its first comment) and text."""
    (script,) = [b for b in section("Under Slurm") if b.text.startswith("#!")]
    name = re.search(r"^# ([\w.-]+):", script.text, re.M)
    assert name, script.text
    return name.group(1), script.text


def test_the_slurm_and_openmpi_sections_are_the_recipes_run_here():
    assert shell_commands("Under OpenMPI") == [
        "mpirun -np 4 python my_train.py",
        "mpirun -np 4 --host host0:2,host1:2 -x MASTER_ADDR=host0 python my_train.py",
    ]
    name, text = batch_script()
    assert shell_commands("Under Slurm") == [f"sbatch {name}"]
    assert "#SBATCH --nodes 2" in text and "srun python my_train.py" in text


def rank_hosts(mpirun_stdout: str) -> dict[int, str]:
    """Each rank's host, from the job map that ``mpirun`` prints (rmaps_base_display_map)."""
    found, node = {}, None
    for line in mpirun_stdout.splitlines():
        if m := re.search(r"Data for node: (\S+)", line):
            node = m.group(1)
        elif m := re.search(r"Process rank: (\d+)", line):
            found[int(m.group(1))] = node
    return found


MPIRUN = {  # the recipe's place in the section, the host it is started on, the host of each rank
    "one host": (0, 1, {0: "host1", 1: "host1", 2: "host1", 3: "host1"}),
    "two hosts": (1, 0, {0: "host0", 1: "host0", 2: "host1", 3: "host1"}),
}


@pytest.mark.parametrize("where", MPIRUN)
def test_mpirun_prints_the_losses_of_torchrun(hosts, scratch, reference, tmp_path, where):
    recipe, started_on, placed = MPIRUN[where]
    command = shell_commands("Under OpenMPI")[recipe]
    env = mpirun_env(scratch, hosts.launch_agent(tmp_path))
    (out,) = hosts.wait([hosts.popen(started_on, ["bash", "-c", command], env=env, cwd=scratch)], TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert rank_hosts(out.stdout) == placed
    torch.testing.assert_close(epoch_losses(out.stdout), reference, rtol=1e-5, atol=0)


def test_the_batch_script_prints_the_losses_of_torchrun(hosts, slurm, scratch, reference):
    name, text = batch_script()
    (scratch / name).write_text(text)
    (command,) = shell_commands("Under Slurm")
    submitted = subprocess.run(slurm.command(["bash", "-c", command]), cwd=scratch, env=slurm.env(job_env(scratch)),
                               capture_output=True, text=True, timeout=60)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(re.fullmatch(r"Submitted batch job (\d+)\n", submitted.stdout).group(1))  # type: ignore[union-attr]
    job = slurm.wait(job_id, TIMEOUT)
    output = (scratch / f"slurm-{job_id}.out").read_text()
    assert job["JobState"] == "COMPLETED", f"{job}\n{output}\n{slurm.logs()}"
    assert (job["NodeList"], job["NumNodes"], job["NumTasks"]) == ("host[0-1]", "2", "4")
    torch.testing.assert_close(epoch_losses(output), reference, rtol=1e-5, atol=0)


# ---- srun: the single-process answer -------------------------------------------------------------


def single_process() -> dict:
    spec = importlib.util.spec_from_file_location("launched_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference()


def drift(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def test_srun_across_two_hosts_trains_to_the_single_process_answer(hosts, slurm, scratch, tmp_path):
    out_file = tmp_path / "result.pt"
    argv = ["srun", "-N2", "--ntasks-per-node", "2", "python", str(SCRIPT), "slurm", str(out_file)]
    (out,) = hosts.wait([hosts.popen(0, argv, env=slurm.env(job_env(scratch)), cwd=tmp_path)], TIMEOUT)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}\n{slurm.logs()}"
    result = torch.load(out_file)
    assert result["launcher"] == "Slurm (srun)" and result["master"] == "host0"
    assert result["hosts"] == ["host0", "host0", "host1", "host1"]
    want = single_process()
    torch.testing.assert_close(result["losses"], want["losses"], rtol=1e-5, atol=0)
    for key, value in want["weights"].items():
        assert drift(result["weights"][key], value) <= 1e-5, (key, drift(result["weights"][key], value))


# ---- what the set-up installs ------------------------------------------------------------------------


def test_make_setup_installs_the_system_packages_these_tests_need():
    recipe = subprocess.run(["make", "-n", "-B", "setup"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert f".ci/system-packages {' '.join(nshosts.SYSTEM_PACKAGES)}" in recipe.stdout.splitlines()
    # as another user than root it installs nothing and names the command (the tests then fail)
    as_nobody = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                str(REPO / ".ci" / "system-packages"), "munge", "tessera-no-such-package"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
    assert as_nobody.returncode == 0, as_nobody.stderr
    assert "as root, `apt-get install --no-install-recommends tessera-no-such-package`" in as_nobody.stderr


def test_a_missing_tool_is_named_with_its_install_command(monkeypatch):
    monkeypatch.setattr(nshosts, "find_tool", lambda tool: None if tool == "srun" else f"/usr/bin/{tool}")
    assert nshosts.missing_tools(["munge"]) is None
    why = nshosts.missing_tools(["munge", "slurm-client"])
    assert why is not None and why.startswith("srun not installed")
    assert f"`{nshosts.INSTALL} slurm-client`" in why


# ---- torchrun across hosts: docs/launch.md's "Several hosts" ------------------------------------


def torchrun_recipes() -> list[str]:
    return [c for c in shell_commands("Several hosts") if c.startswith("tessera run ")]


def test_the_torchrun_recipes_across_two_hosts_print_the_losses_of_one_host(hosts, scratch, reference):
    static_host0, static_host1, dynamic = torchrun_recipes()
    assert "--node-rank 0" in static_host0 and "--node-rank 1" in static_host1 and "c10d" in dynamic
    env = job_env(scratch)
    # the two jobs use the same port: side by side, each on hosts of its own (another pair of namespaces)
    # (and in a copy of the folder: a run folder is named after the second it started in)
    apart = shutil.copytree(scratch, scratch.parent / f"{scratch.name}-c10d", dirs_exist_ok=True)
    with nshosts.Hosts(2, net=232) as others:
        started = [(per_host, on, [on.popen(k, ["bash", "-c", c], env=env, cwd=cwd) for k, c in enumerate(per_host)])
                   for per_host, on, cwd in (([static_host0, static_host1], hosts, scratch),
                                             ([dynamic, dynamic], others, apart))]  # fmt: skip
        for per_host, on, procs in started:
            outs = on.wait(procs, TIMEOUT)
            for out in outs:
                assert out.returncode == 0, f"{per_host[out.host]} on host{out.host}:\n{out.stdout}\n{out.stderr}"
            # rank 0 prints: on host0 under the static rendezvous, on either host under c10d
            torch.testing.assert_close(epoch_losses("".join(o.stdout for o in outs)), reference, rtol=1e-5, atol=0)
