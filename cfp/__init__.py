"""cfp: channel and filter parallelism for CNN training (Dryden et al., SC'19) on MPI ranks.

The design is docs/design.md. mpi4py is imported by the modules that communicate or run under
mpiexec (backend, benchtools, cli, comm, grid, tensor, train); `cfp.kernels`, partition,
perfmodel and planner do not import it themselves.
"""
__version__ = "0.1.0"
