"""Bad input to cfp's Python API, one case per run, under mpiexec and cfp.cli.run (as a user's
own script would run it): `mpiexec -n 2 python -m mpi4py api_case.py CASE`.

Every case must end the job with one clear message and a non-zero exit, however the ranks
differ; tests/test_bad_input.py runs them."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from cfp import cli, comm  # noqa: E402
from cfp.algorithms import make_conv  # noqa: E402
from cfp.grid import ProcessGrid  # noqa: E402
from cfp.kernels import conv2d_forward  # noqa: E402
from cfp.tensor import DistTensor, Layout  # noqa: E402
from cfp.train import TrainConfig, train  # noqa: E402

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()


def layer(algorithm="y", C=4, F=4, grid=None):
    """A 3x3 convolution on the channel=P grid, with its weight shard."""
    grid = grid or ProcessGrid(f"channel={SIZE}")
    conv = make_conv(algorithm, grid, C, F, 3, padding=1)
    return conv, conv.shard_weight(np.ones((F, C, 3, 3))), conv.shard_bias(np.zeros(F))


def x_block(conv, n=2, H=6, W=5, dtype=np.float64):
    return np.ones((n, len(conv.x_channels), H, W), dtype=dtype)


def heights_differ():
    conv, w, b = layer()
    conv.forward(x_block(conv, H=6 if RANK == 0 else 5), w, b)


def dtypes_differ():
    conv, w, b = layer()
    dtype = np.float32 if RANK == 0 else np.float64
    conv.forward(x_block(conv, dtype=dtype), w.astype(dtype), b.astype(dtype))


def samples_differ():
    conv, w, b = layer(grid=ProcessGrid(f"sample={SIZE}"), algorithm="sample")
    conv.forward(x_block(conv, n=3 if RANK == 0 else 1), w, b)  # not the blocks of one batch


def integer_input():
    conv, w, b = layer()
    conv.forward(x_block(conv).astype(np.int64), w, b)


def complex_input():
    conv, w, b = layer()
    conv.forward(x_block(conv).astype(np.complex128), w, b)


def weight_dtype_differs():
    conv, w, b = layer()
    conv.forward(x_block(conv), w.astype(np.float32), b)


def spatial_grid():
    """A 1-row image over the height axis: too small for the grid."""
    conv, w, b = layer(grid=ProcessGrid(f"height={SIZE}"))
    conv.forward(x_block(conv, H=1 if RANK == 0 else 0), w, b)


def backward_first():
    conv, _, _ = layer()
    conv.backward(np.ones((2, 2, 6, 5)))


def wrong_grad_output():
    conv, w, b = layer()
    y = conv.forward(x_block(conv), w, b)
    conv.backward(np.ones((y.shape[0], y.shape[1], y.shape[2] + 1, y.shape[3])))


def integer_kernel_input():
    conv2d_forward(np.ones((1, 2, 5, 5), dtype=np.int64), np.ones((3, 2, 3, 3), dtype=np.int64))


def wrong_block():
    grid = ProcessGrid(f"sample={SIZE}")
    DistTensor(np.ones((5, 3)), (4, 3), Layout(("sample", None)), grid)


def collective_shapes_differ():
    comm.allgather(MPI.COMM_WORLD, np.ones((2, 1, 5 + RANK)), 1, [1] * SIZE)


def collective_dtypes_differ():
    comm.allreduce(MPI.COMM_WORLD, np.ones(3, dtype=np.float32 if RANK else np.float64))


def own_status():
    return 3  # a script that ends with a status of its own, and no message


def train_zero_steps():
    train(TrainConfig(max_steps=0, grid=f"channel={SIZE}", progress=False))


def fails_with_requests_outstanding():
    """Every rank starts a gradient-sized iallreduce and an iallgather; the last rank fails
    before waiting for them, while the others wait and go on into the next collective."""
    world = MPI.COMM_WORLD
    summed = comm.iallreduce(world, np.ones(1 << 20))
    gathered = comm.iallgather(world, np.ones((2, 3)), 0, [2] * SIZE)
    if RANK == SIZE - 1:
        raise ValueError(f"rank {RANK} fails while its collectives are in flight")
    summed.wait()
    gathered.wait()
    comm.allreduce(world, np.ones(3))  # the failed rank never comes


def fails_with_requests_outstanding_under_a_progress_thread():
    """The same, while comm.progress_thread tests the collectives in flight on every rank."""
    with comm.progress_thread():
        fails_with_requests_outstanding()


CASES = {f.__name__: f for f in (fails_with_requests_outstanding,
                                 fails_with_requests_outstanding_under_a_progress_thread, heights_differ,
                                 dtypes_differ, samples_differ, integer_input, complex_input, weight_dtype_differs, spatial_grid, backward_first, wrong_grad_output,
                                 integer_kernel_input, wrong_block, collective_shapes_differ,
                                 collective_dtypes_differ, own_status, train_zero_steps)}


def main(argv):
    return CASES[sys.argv[1]]() or 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
