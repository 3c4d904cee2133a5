"""The engine that runs local SGD: the training loop, optimizers, local training as data, and batched training."""
