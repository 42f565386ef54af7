"""Native CPU kernels for the products XLA's CPU backend runs far below memory bandwidth.

Each kernel is C++ source beside its JAX wrapper, compiled on first use for this machine (see `build`) and
called through XLA's FFI; without a compiler, or on a CPU the kernel is not for, the wrapper's caller keeps
XLA's own product.
"""
