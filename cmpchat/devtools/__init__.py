"""Developer checks of the compiled kernels: compute_70 PTX and SASS free of tensor-core instructions."""
