//! placeholder: the CUDA backend (issue 4).
