"""cfp: channel and filter parallelism for CNN training (Dryden et al., SC'19) on MPI ranks.

Submodules: backend, partition, grid, comm, tensor, kernels. MPI is imported only by the
modules that communicate (grid, comm, tensor), so `cfp.kernels` works without it.
"""
__version__ = "0.1.0"
