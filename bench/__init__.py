"""Benchmarks: fedsim against the shared peer harness (plain PyTorch loop, Flower) and the stress runs."""
