"""tessera.job_env: which launcher started a process, and where its rank 0 is, from the environment
alone (tests/e2e/test_mpi_slurm.py runs the real launchers)."""

from __future__ import annotations

import pytest

from tessera import job_env
from tessera.errors import ConfigError

SRUN_TASK = {
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NTASKS": "8",  # the job's: a step may use fewer tasks
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_JOB_NODELIST": "node[06-08]",
    "SLURM_JOB_ID": "123456",
}
MPIRUN_RANK = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}


def test_outside_any_launcher_there_is_no_job():
    assert job_env.detect({"PATH": "/usr/bin"}) is None


def test_a_slurm_task_meets_on_the_first_node_of_its_step_on_a_port_of_its_job():
    job = job_env.detect(SRUN_TASK)
    assert job == job_env.JobEnv(job_env.SLURM, rank=3, world_size=4, local_rank=1, host="node07", port=29956)
    overridden = job_env.detect({**SRUN_TASK, "MASTER_ADDR": "login", "MASTER_PORT": "4000"})
    assert overridden is not None and (overridden.host, overridden.port) == ("login", 4000)
    assert job_env.slurm_env(SRUN_TASK, host="h", port=5).host == "h"


def test_a_batch_scripts_shell_is_no_task():
    batch_shell = {k: v for k, v in SRUN_TASK.items() if not k.startswith("SLURM_STEP")}
    assert job_env.detect(batch_shell) is None
    # launch_from_slurm, asked explicitly, takes the job's numbers
    job = job_env.slurm_env(batch_shell)
    assert (job.world_size, job.host) == (8, "node06")


def test_openmpi_across_hosts_needs_master_addr():
    with pytest.raises(ConfigError, match=r"mpirun -x MASTER_ADDR="):
        job_env.detect(MPIRUN_RANK)
    job = job_env.detect({**MPIRUN_RANK, "MASTER_ADDR": "host0"})
    assert job == job_env.JobEnv(job_env.OPENMPI, rank=2, world_size=4, local_rank=0, host="host0", port=29500)
    one_host = job_env.detect({**MPIRUN_RANK, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert one_host is not None and one_host.host == "127.0.0.1"


def test_torchrun_comes_first_then_openmpi():
    inside_a_step = {**SRUN_TASK, **MPIRUN_RANK, "MASTER_ADDR": "a"}
    job = job_env.detect(inside_a_step)
    assert job is not None and job.launcher == job_env.OPENMPI
    torchrun = {**inside_a_step, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_PORT": "29400"}
    assert job_env.detect(torchrun) == job_env.JobEnv(job_env.TORCHRUN, 5, 8, 1, "a", 29400)
    with pytest.raises(ConfigError, match="LOCAL_RANK is not set: this process was not started by torchrun"):
        job_env.detect({"RANK": "0", "WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    ("hostlist", "names"),
    [
        ("host0", ["host0"]),
        ("host[0-1]", ["host0", "host1"]),
        ("node[01-03,7],login", ["node01", "node02", "node03", "node7", "login"]),
        ("rack[1-2]-n[3-4]", ["rack1-n3", "rack1-n4", "rack2-n3", "rack2-n4"]),
    ],
)
def test_slurm_hostlists_expand_as_scontrol_show_hostnames_does(hostlist, names):
    assert job_env.expand_hostlist(hostlist) == names


def test_a_hostlist_that_cannot_be_read_is_named():
    with pytest.raises(ConfigError, match=r"'a-b'"):
        job_env.expand_hostlist("n[a-b]")
