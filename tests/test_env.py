"""Rank/size discovery from launcher environments, and the errors for broken ones."""
import pytest

from pycoll.bootstrap.env import discover
from pycoll.errors import EnvError

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
OMPI = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
PMI = {"PMI_RANK": "3", "PMI_SIZE": "5", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2",
         "SLURM_NTASKS_PER_NODE": "3(x2)", "MASTER_ADDR": "node1"}


def test_singleton_when_nothing_is_set():
    job = discover(env={})
    assert (job.rank, job.size, job.source) == (0, 1, "singleton")


@pytest.mark.parametrize("env, expect", [
    (TORCHRUN, ("torchrun", 1, 4, 1, 2)),
    (OMPI, ("openmpi", 2, 8, 0, 4)),
    (PMI, ("pmi", 3, 5, 1, 2)),
    (SLURM, ("slurm", 5, 6, 2, 3)),
])
def test_each_launcher(env, expect):
    job = discover(env=env)
    assert (job.source, job.rank, job.size, job.local_rank, job.local_size) == expect


def test_precedence_args_then_torchrun_then_mpi_then_pmi_then_slurm():
    everything = {**SLURM, **PMI, **OMPI, **TORCHRUN}
    assert discover(env=everything).source == "torchrun"
    assert discover(rank=0, size=2, env={**everything, "MASTER_ADDR": "h"}).source == "args"
    no_torch = {k: v for k, v in everything.items() if k not in ("RANK", "WORLD_SIZE")}
    assert discover(env=no_torch).source == "openmpi"
    assert discover(env={**SLURM, **PMI}).source == "pmi"


def test_master_address_and_default_port():
    job = discover(env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    assert (job.master_addr, job.master_port) == ("h", 29500)
    assert discover(env=TORCHRUN).master_port == 1234


@pytest.mark.parametrize("env, words", [
    ({"RANK": "0"}, ["RANK", "WORLD_SIZE"]),
    ({"WORLD_SIZE": "2"}, ["WORLD_SIZE", "RANK"]),
    ({"OMPI_COMM_WORLD_RANK": "0"}, ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"]),
    ({"PMI_SIZE": "2"}, ["PMI_SIZE", "PMI_RANK"]),
    ({"SLURM_PROCID": "0"}, ["SLURM_PROCID", "SLURM_NTASKS"]),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, ["RANK", "'x'"]),
    ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "h"}, ["rank 4", "0..3"]),
    ({"RANK": "0", "WORLD_SIZE": "0"}, ["world size 0"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, ["MASTER_PORT", "MASTER_ADDR"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, ["99999"]),
    ({"RANK": "1", "WORLD_SIZE": "2"}, ["MASTER_ADDR", "rendezvous"]),
    ({"PYCOLL_JOB_TOKEN": "zz"}, ["PYCOLL_JOB_TOKEN"]),
])
def test_broken_environments_name_the_variables(env, words):
    with pytest.raises(EnvError) as err:
        discover(env=env)
    for word in words:
        assert word in str(err.value)


def test_half_explicit_arguments():
    with pytest.raises(EnvError, match="rank= and size="):
        discover(rank=0, env={})


def test_mpi_without_master_addr_is_allowed():
    job = discover(env=OMPI)
    assert job.master_addr is None and job.master_port is None


def test_token_and_hosted_store():
    job = discover(env={**TORCHRUN, "PYCOLL_JOB_TOKEN": "abcd", "PYCOLL_STORE_HOSTED": "1"})
    assert job.token == b"\xab\xcd" and job.store_hosted


def test_launcher_store_port_leaves_master_port_to_torch():
    job = discover(env={**TORCHRUN, "PYCOLL_STORE_PORT": "29601"})
    assert job.store_port == 29601 and job.store_hosted and job.master_port == int(TORCHRUN["MASTER_PORT"])
    assert discover(env=TORCHRUN).store_port is None


def test_store_port_without_master_addr_is_an_error():
    env = {k: v for k, v in TORCHRUN.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    with pytest.raises(EnvError, match="PYCOLL_STORE_PORT"):
        discover(env={**env, "PYCOLL_STORE_PORT": "29601"})
