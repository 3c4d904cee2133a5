"""Upper bounds shared by config knobs: far above any real experiment, low enough that a typo cannot run forever
or allocate terabytes."""

from __future__ import annotations

MAX_SEED = 2**32 - 1  # seeds are mixed into torch and numpy seeds with arithmetic; keep them in 32 bits
MAX_ROUNDS = 1_000_000
MAX_EPOCHS = 10_000  # passes over a dataset, per round or per phase
MAX_STEPS = 1_000_000  # optimizer steps, per round or per phase
MAX_BATCH = 1_000_000
MAX_CLIENTS = 100_000_000
MAX_SAMPLES = 10_000_000  # samples a method generates or draws (synthetic sets, proxy sets, patch pools)
MAX_CLASSES = 100_000
MAX_WIDTH = 65_536  # channels, hidden units, noise dimensions
MAX_WORKERS = 4096
MAX_SWEEP_RUNS = 10_000  # runs one sweep plans (grid points x samples x arms x seeds)
MAX_CPUS = 1024
MAX_GPUS = 64
MAX_THREADS = 1024
MAX_SECONDS = 1e9  # wall-clock timeouts (about 31 years; larger values overflow timers)
MAX_BYTES = 2**60
MAX_CHANNELS = 4096  # convolution channels
MAX_ARRAY_BYTES = 2**36  # one generated array (a synthetic set, a patch pool): 64 GiB
MAX_CONFIG_BYTES = 2**20  # a config, sweep or override file: real ones hold kilobytes (checked before it is read)
MAX_CONFIG_VALUES = 20_000  # values in one YAML document, aliases expanded (counted before any is built)
MAX_CONFIG_DEPTH = 100  # nesting of one YAML document
