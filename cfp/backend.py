"""Array-module selection (NumPy or CuPy), host staging for MPI, and per-rank BLAS threads.

Everything above this module asks `get_array_module(x)` for the `xp` of an array instead of
importing numpy or cupy directly, so one code path serves the CPU and the GPU.
"""
import functools
import os

import numpy as np

from .checks import positive_int

try:  # CuPy is optional: cfp runs on NumPy alone.
    import cupy as _cupy
except Exception:  # ImportError, or a CuPy without a usable CUDA driver
    _cupy = None


def cupy_available():
    """True when CuPy imports (a GPU may still be absent at run time)."""
    return _cupy is not None


def get_array_module(*arrays):
    """numpy, or cupy when any of `arrays` is a CuPy array."""
    if _cupy is not None:
        for a in arrays:
            if isinstance(a, _cupy.ndarray):
                return _cupy
    return np


def is_device_array(x):
    return _cupy is not None and isinstance(x, _cupy.ndarray)


def to_host(x):
    """A NumPy view or copy of `x` that MPI can read.

    CuPy arrays are copied to the host after their stream is synchronised (a kernel still
    writing `x` would otherwise race with the copy); NumPy arrays pass through unchanged.
    """
    if is_device_array(x):
        synchronize(x)
        return _cupy.asnumpy(x)
    return x


def from_host(x, xp):
    """`x` (a NumPy array) as an array of module `xp`."""
    if xp is np:
        return x
    return xp.asarray(x)


_FEW_RUNS = 8  # take and put: up to this many runs of consecutive indices go as slices


def _runs(indices):
    """The runs of consecutive values of the sorted list `indices`, as (start, stop) positions
    in it, or None where there are more than _FEW_RUNS of them (take and put then index)."""
    breaks = [i for i in range(1, len(indices)) if indices[i] != indices[i - 1] + 1]
    if len(breaks) >= _FEW_RUNS:
        return None
    return list(zip([0] + breaks, breaks + [len(indices)])) if indices else []


def take(x, axis, indices):
    """x's entries at the global `indices` (a sorted list or range) along `axis`, as a fresh
    C-contiguous array: one slice copied where they are consecutive (every layout cfp makes),
    the slices side by side where they are a few runs of consecutive ones (a union of blocks, a
    feature chunk: one copy, 4-7 times faster than a gather along an inner axis), else a
    gather by an index array made once per array module (cached: no host-to-device copy of the
    indices each step)."""
    xp = get_array_module(x)
    indices = list(indices)
    runs = _runs(indices)
    if runs is not None:
        at = [slice(None)] * x.ndim
        pieces = []
        for a, b in runs or [(0, 0)]:
            at[axis] = slice(indices[a], indices[b - 1] + 1) if b > a else slice(0, 0)
            pieces.append(x[tuple(at)])
        return xp.array(pieces[0], order="C", copy=True) if len(pieces) == 1 else xp.concatenate(pieces, axis=axis)
    return xp.ascontiguousarray(xp.take(x, index_array(np.asarray(indices, dtype=np.intp), xp), axis=axis))


def put(out, axis, indices, values):
    """out's entries at the global `indices` (a sorted list) along `axis` set to `values` (of
    their extent there), in place: as take reads them, slice by slice where they are a few runs
    of consecutive indices, else by an index array."""
    xp = get_array_module(out)
    indices = list(indices)
    runs = _runs(indices)
    at = [slice(None)] * out.ndim
    if runs is None:
        at[axis] = index_array(np.asarray(indices, dtype=np.intp), xp)
        out[tuple(at)] = values
        return out
    source = [slice(None)] * out.ndim
    for a, b in runs:
        at[axis], source[axis] = slice(indices[a], indices[b - 1] + 1), slice(a, b)
        out[tuple(at)] = values[tuple(source)]
    return out


def index_array(indices, xp):
    """The host index array `indices` (or a key of several: np.ix_'s) as arrays of module `xp`,
    made once per content and module (a small cache), so that a layer indexing device arrays
    the same way each step copies its indices to the device once."""
    if xp is np:
        return indices
    if isinstance(indices, tuple):
        return tuple(index_array(a, xp) if isinstance(a, np.ndarray) else a for a in indices)
    a = np.asarray(indices)
    return _index_array(a.tobytes(), a.shape, a.dtype.str, xp)


@functools.lru_cache(maxsize=256)
def _index_array(data, shape, dtype, xp):
    return xp.asarray(np.frombuffer(data, dtype=dtype).reshape(shape))


DEVICES = ("cpu", "gpu")


def array_module(device):
    """The array module of `device`: numpy for 'cpu', cupy for 'gpu'. ValueError naming the
    missing piece where CuPy is not installed or sees no GPU (the same on every rank of a node
    alike; train.py checks it on every rank before any work)."""
    if device == "cpu":
        return np
    if device != "gpu":
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
    if _cupy is None:
        raise ValueError("--device gpu needs CuPy, which does not import here (install the wheel for this "
                         "machine's CUDA, e.g. pip install cupy-cuda12x); --device cpu runs on NumPy")
    try:
        count = _cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDARuntimeError: no driver, or no device
        raise ValueError(f"--device gpu: CuPy finds no usable GPU here ({error}); --device cpu runs on "
                         f"NumPy") from None
    if count < 1:
        raise ValueError("--device gpu: CuPy sees no GPU here; --device cpu runs on NumPy")
    return _cupy


@functools.lru_cache(maxsize=1)
def mpi_cuda_support():
    """What the MPI library in this process says of CUDA buffers: (True, False or None when it
    has no way to say, a description). Open MPI and MPICH (4 and later) answer through
    MPIX_Query_cuda_support(), which mpi4py does not wrap: it is looked up in the loaded MPI
    library. MPICH also needs MPIR_CVAR_ENABLE_GPU=1 at run time, which its answer reflects."""
    import ctypes
    import re
    from mpi4py import MPI
    version = MPI.Get_library_version().splitlines()[0].strip()
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if re.search(r"/libmpi[^/]*\.so", line)})
    except OSError:
        pass
    for path in paths:
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        supported = bool(query())
        return supported, f"{version}: MPIX_Query_cuda_support() = {int(supported)}"
    return None, f"{version}: no MPIX_Query_cuda_support in its library"


def device_buffers_to_mpi(xp):
    """(whether cfp passes `xp`'s device arrays to MPI as they are, why): CFP_CUDA_AWARE=1 or 0
    forces it on or off; unset, it is on where the MPI library says it reads CUDA buffers and
    the arrays expose __cuda_array_interface__ (how mpi4py hands them to MPI), else every
    message is staged through host buffers. ValueError for CFP_CUDA_AWARE=1 where MPI or the
    arrays cannot (checked at start by use_device, on every rank), or a value other than 0/1."""
    forced = os.environ.get("CFP_CUDA_AWARE", "")
    if forced not in ("", "0", "1"):
        raise ValueError(f"CFP_CUDA_AWARE={forced!r}: expected 0 (stage device buffers through the host) or 1 "
                         f"(hand them to a CUDA-aware MPI)")
    if xp is np or forced == "0":
        return False, "NumPy arrays" if xp is np else "CFP_CUDA_AWARE=0"
    exposed = hasattr(xp.empty(1), "__cuda_array_interface__")
    supported, why = mpi_cuda_support()
    if forced == "1":
        if not exposed:
            raise ValueError(f"CFP_CUDA_AWARE=1, but this CuPy's arrays expose no __cuda_array_interface__ "
                             f"for MPI to read; unset it (or 0) to stage messages through the host")
        if supported is False:
            raise ValueError(f"CFP_CUDA_AWARE=1, but MPI reads no CUDA buffers here ({why}); unset it (or 0) "
                             f"to stage messages through the host")
        return True, f"CFP_CUDA_AWARE=1 ({why})"
    if exposed and supported:
        return True, why
    return False, why if exposed else "the arrays expose no __cuda_array_interface__"


def synchronize(x):
    """Wait for the device work writing `x` (its current stream) to finish; nothing for a NumPy
    array. MPI is not stream-aware, so a device buffer is synchronised before MPI reads it (and
    a benchmark's clock stops only after it)."""
    if is_device_array(x):
        _cupy.cuda.get_current_stream().synchronize()


# What launchers tell each process about its place among the job's processes on its node
LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def local_rank(comm=None):
    """This process's index among the job's processes on its node: the launcher's where it
    says, otherwise its rank among the ranks of `comm` (default COMM_WORLD) sharing the node."""
    for name in LOCAL_RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return _on_this_node(comm)[0]


def _on_this_node(comm=None):
    """(rank, size) of this process among the ranks of `comm` (default COMM_WORLD) that share
    its node (collective over comm)."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD if comm is None else comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def use_device(device, comm=None):
    """Make this rank's device current and return (xp, where): for 'gpu' the GPU of index
    node-local rank % GPUs on the node (one GPU per rank where there are enough; ranks share
    one otherwise), `where` a dict {"device", "index", "count", "host", "name"}; for 'cpu'
    numpy and {"device": "cpu"}. Collective over `comm` (default COMM_WORLD): where a rank
    lacks CuPy or a GPU, every rank raises the same ValueError (naming the first such rank's
    problem) before any work."""
    import socket
    from mpi4py import MPI
    from .checks import checked_on_every_rank
    comm = MPI.COMM_WORLD if comm is None else comm
    xp = checked_on_every_rank(comm, lambda: array_module(device))
    if xp is np:
        return np, {"device": "cpu"}
    aware, why = checked_on_every_rank(comm, lambda: device_buffers_to_mpi(xp))
    global _device_buffers
    _device_buffers = aware
    count = xp.cuda.runtime.getDeviceCount()
    index = local_rank(comm) % count
    xp.cuda.Device(index).use()
    name = xp.cuda.runtime.getDeviceProperties(index).get("name", b"")
    return xp, {"device": "gpu", "index": index, "count": count, "host": socket.gethostname(),
                "name": name.decode() if isinstance(name, bytes) else str(name),
                "messages": ("device buffers to MPI" if aware else "staged through host buffers") + f" ({why})"}


_device_buffers = False  # set by use_device: device arrays go to MPI as they are


def mpi_buffer(x):
    """x as a C-contiguous array MPI can read: x (or a contiguous copy) where it is a device
    array and use_device chose device buffers (its stream synchronised first), else a host
    array (to_host)."""
    if _device_buffers and is_device_array(x):
        x = _cupy.ascontiguousarray(x)
        synchronize(x)
        return x
    return np.ascontiguousarray(to_host(x))


# What launchers tell each process about the job's processes on its node (MPICH's Hydra, Open
# MPI): every one of them shares this node's cores, whatever communicator a rank computes on.
LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def local_rank_count(comm=None):
    """Number of MPI processes sharing this node: the launcher's count of the job's processes
    here where it gives one (so a rank that trains alone on COMM_SELF, beside the others,
    still counts them), otherwise the ranks of `comm` (default COMM_WORLD) on this node; 1 when
    MPI is not initialised here."""
    for name in LOCAL_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return 1
    return _on_this_node(comm)[1]


def default_blas_threads(local_ranks=1, cores=None):
    """cores // local_ranks, at least 1: the BLAS threads each rank gets by default."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, int(cores) // max(1, int(local_ranks)))


def set_blas_threads(threads=None, comm=None):
    """Limit the BLAS thread pools of this process and return the count used.

    `threads=None` means cores // (ranks on this node), so that P ranks on one node do not
    oversubscribe its cores. The limit holds for the rest of the process (threadpoolctl keeps
    the returned controller's effect until it is undone).
    """
    from threadpoolctl import threadpool_limits

    if threads is None:
        threads = default_blas_threads(local_rank_count(comm))
    threads = positive_int(threads, "BLAS threads")
    threadpool_limits(limits=threads, user_api="blas")
    return threads


def blas_info():
    """[(library, version, threads, architecture)] of the BLAS libraries loaded here."""
    from threadpoolctl import threadpool_info

    return [
        (i.get("internal_api"), i.get("version"), i.get("num_threads"), i.get("architecture"))
        for i in threadpool_info()
        if i.get("user_api") == "blas"
    ]


def numpy_blas_info():
    """blas_info's entries of the BLAS library NumPy itself calls, which runs cfp's kernels'
    GEMMs: the one loaded from NumPy's own folders (a wheel's numpy.libs), else the one of the
    version NumPy was built with, else every one loaded. SciPy brings an OpenBLAS of its own,
    loaded once scipy.linalg or scipy.optimize is imported, so blas_info's list depends on what
    a process imported first; this one does not."""
    from threadpoolctl import threadpool_info

    loaded = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    root = os.path.realpath(os.path.dirname(np.__file__))
    mine = [i for i in loaded if os.path.realpath(i.get("filepath") or "").startswith((root + os.sep, root + ".libs"))]
    if not mine:
        try:
            version = np.show_config(mode="dicts")["Build Dependencies"]["blas"].get("version")
        except Exception:  # an older NumPy
            version = None
        mine = [i for i in loaded if version and i.get("version") == version] or loaded
    return [(i.get("internal_api"), i.get("version"), i.get("num_threads"), i.get("architecture")) for i in mine]


# OpenBLAS's x86-64 kernels (threadpoolctl's 'architecture') that run float32 and float64 GEMMs
# with AVX-512
_AVX512_KERNELS = ("skylakex", "cooperlake", "sapphirerapids")


@functools.lru_cache(maxsize=None)
def blas_runs_avx512():
    """Whether the BLAS loaded here runs AVX-512 GEMMs: OpenBLAS by the kernels it chose (or
    OPENBLAS_CORETYPE chose for it), another library where the CPU has AVX-512 (Linux's flags).
    What the Winograd tile's cost weighs (kernels/conv/winograd.py). Fixed for the process."""
    loaded = numpy_blas_info()
    openblas = [arch for lib, _, _, arch in loaded if lib == "openblas" and arch]
    if openblas:
        return openblas[0].lower() in _AVX512_KERNELS
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and " avx512f" in line for line in cpuinfo)
    except OSError:
        return False


def blas_description():
    """'openblas 0.3.31.188.0 (SkylakeX)': the BLAS libraries loaded here and the kernels each
    runs, for a benchmark's header. The kernels move the rates: OpenBLAS's Haswell (AVX2) and
    SkylakeX (AVX-512) kernels, which OPENBLAS_CORETYPE chooses between, ran cfp's convolutions
    1.4-1.7x apart on one CPU (BENCHMARKS.md)."""
    return ", ".join(f"{lib} {version} ({arch})" if arch else f"{lib} {version}"
                     for lib, version, _, arch in blas_info()) or "unknown"


def cpu_name():
    """The processor's model name (Linux's /proc/cpuinfo, else what platform says)."""
    import platform
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
