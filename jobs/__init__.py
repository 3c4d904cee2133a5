"""Job driver and entry points: the CLI, `python -m jobs.run` for `ray job submit`, sweeps, stress tests."""
