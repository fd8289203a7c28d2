"""Kernel validation (`deepinfer validate-kernels`, installed as deepinfer.validate): every CUDA kernel against its
torch reference on fresh random inputs, a CUDA graph of kernels against an eager run, and a tiny model's logits on
the native path against the reference path. run.py runs the checks and writes the report; tests/test_kernels_gpu.py
shares the helpers (compare.py, inputs.py) with its own cases and bounds."""
