"""Benchmarks: fedsim against a plain PyTorch loop and Flower on the bench's own FedAvg workload; stress runs."""
