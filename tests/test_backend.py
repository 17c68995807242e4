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


def test_local_rank_comes_from_the_launcher_first(monkeypatch):
    """The GPU a rank takes is its node-local rank modulo the GPUs (use_device): the
    launcher's local rank where it gives one, else the rank among the communicator's on the node."""
    from mpi4py import MPI
    for name in backend.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert backend.local_rank(MPI.COMM_SELF) == 0
    for name in backend.LOCAL_RANK_VARIABLES:
        monkeypatch.setenv(name, "5")
        assert backend.local_rank(MPI.COMM_SELF) == 5, name
        monkeypatch.delenv(name)


def test_the_mpi_library_is_asked_about_cuda_buffers(monkeypatch):
    from mpi4py import MPI
    supported, why = backend.mpi_cuda_support()
    assert supported in (True, False, None)
    assert why.startswith(MPI.Get_library_version().splitlines()[0].strip())
    assert backend.device_buffers_to_mpi(np) == (False, "NumPy arrays")  # host arrays need no staging
    monkeypatch.setenv("CFP_CUDA_AWARE", "yes")
    with pytest.raises(ValueError, match="CFP_CUDA_AWARE='yes': expected 0 .* or 1"):
        backend.device_buffers_to_mpi(np)


def test_take_copies_one_slice_or_gathers():
    """One run of consecutive indices, a few (a union of blocks, a feature chunk: slices side by
    side), or many (a gather), along any axis: a fresh C-contiguous copy of x's entries; put
    writes such entries in place."""
    x = np.arange(2 * 20 * 3.0).reshape(2, 20, 3)
    many = list(range(0, 20, 2))  # 10 runs, more than backend._FEW_RUNS
    assert len(many) > backend._FEW_RUNS
    for axis in (0, 1, 2):
        extent = x.shape[axis]
        for indices in ([1, 2, 3], range(0, 6), [0, 2, 5], [0, 1, 5, 6, 7, 12], [], many, [extent - 1]):
            indices = [i for i in indices if i < extent]
            got = backend.take(x, axis, indices)
            assert got.flags.c_contiguous and not np.shares_memory(got, x)
            assert np.array_equal(got, np.take(x, indices, axis=axis)), (axis, indices)
            # put writes them back where take read them, and nothing else
            out = np.zeros_like(x)
            assert backend.put(out, axis, indices, got) is out
            expected = np.zeros_like(x)
            at = [slice(None)] * x.ndim
            at[axis] = indices
            expected[tuple(at)] = got
            assert np.array_equal(out, expected), (axis, indices)
