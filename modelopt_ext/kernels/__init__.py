"""GPU kernels written in Triton. Imported only on CUDA paths: CPU installs need no Triton."""
