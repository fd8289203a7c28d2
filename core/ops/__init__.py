"""Op dispatch: each op runs a CUDA kernel when one can serve the case, its torch reference otherwise."""
