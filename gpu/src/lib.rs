//! CUDA kernels for the Mamba-2 SSD forward (to come).
