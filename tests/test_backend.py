"""Array-module selection, host staging and BLAS thread control."""
import numpy as np
import pytest

from cfp import backend


def test_numpy_arrays_stay_on_the_host():
    x = np.arange(6.0)
    assert backend.get_array_module(x) is np
    assert backend.to_host(x) is x
    assert backend.from_host(x, np) is x
    assert not backend.is_device_array(x)


def test_default_threads_divide_cores_among_local_ranks():
    assert backend.default_blas_threads(local_ranks=2, cores=8) == 4
    assert backend.default_blas_threads(local_ranks=4, cores=2) == 1
    assert backend.default_blas_threads(local_ranks=3, cores=8) == 2


def test_ranks_on_the_node_come_from_the_launcher_first(monkeypatch):
    """A rank that computes alone on COMM_SELF (a serial reference run beside the others) still
    shares the node's cores with the job's other processes: the launcher's count of them wins
    over the communicator's, and without one the communicator's ranks on the node count."""
    from mpi4py import MPI
    for name in backend.LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert backend.local_rank_count(MPI.COMM_SELF) == 1
    for name in backend.LOCAL_SIZE_VARIABLES:
        monkeypatch.setenv(name, "3")
        assert backend.local_rank_count(MPI.COMM_SELF) == 3, name
        monkeypatch.setenv(name, "none")  # not a count: the next source decides
    assert backend.local_rank_count(MPI.COMM_SELF) == 1


def test_set_blas_threads():
    assert backend.set_blas_threads(1) == 1
    assert all(threads == 1 for _, _, threads, _ in backend.blas_info())
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="BLAS threads must be a positive integer"):
            backend.set_blas_threads(bad)


def test_cupy_round_trip():
    cupy = pytest.importorskip("cupy")
    try:
        x = cupy.arange(6.0)
    except Exception as e:  # CuPy installed without a usable GPU
        pytest.skip(f"no usable GPU: {e}")
    assert backend.get_array_module(x) is cupy
    host = backend.to_host(x)
    assert isinstance(host, np.ndarray) and np.array_equal(host, np.arange(6.0))
    assert backend.get_array_module(backend.from_host(host, cupy)) is cupy
