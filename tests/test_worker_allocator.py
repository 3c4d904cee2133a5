"""A process fedsim owns (a Ray worker, the `fedsim` command's) keeps its freed blocks for the next client instead
of faulting fresh pages in each time."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHURN = """
import resource, sys
import numpy as np
if sys.argv[1] == "kept":
    from fedsim.runtime.allocator import keep_freed_blocks
    assert keep_freed_blocks()
blocks = [np.ones(2**18) for _ in range(3)]  # 2 MB each: what a client's upload and buffers look like
del blocks
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):  # allocate, touch and free three 2 MB blocks, as every client does
    blocks = [np.ones(2**18) for _ in range(3)]
    del blocks
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    env_free = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, env=env_free,
                         timeout=120, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_worker_reuses_freed_blocks_instead_of_faulting_in_fresh_pages():
    """By default glibc gives the freed top of the heap back, so the next 6 MB faults in ~1,500 pages again; a worker
    process keeps them (120 rounds of 512 pages faulted in, against next to none)."""
    default, kept = _faults("default"), _faults("kept")
    assert default > 20_000 and kept < default / 10, (default, kept)


@pytest.mark.parametrize("variable, value", [("MALLOC_TRIM_THRESHOLD_", "1000000"), ("MALLOC_ARENA_MAX", "2"),
                                             ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")])
def test_glibc_settings_the_user_made_are_left_alone(monkeypatch, variable, value):
    from fedsim.runtime.allocator import keep_freed_blocks

    monkeypatch.setenv(variable, value)
    assert keep_freed_blocks() is False


def test_the_fedsim_command_tunes_its_own_process_and_a_library_call_does_not(monkeypatch, capsys):
    import jobs.cli as cli

    calls: list[int] = []
    monkeypatch.setattr(cli, "keep_freed_blocks", lambda: calls.append(1) or True)
    monkeypatch.setattr(sys, "argv", ["fedsim", "config-reference"])
    assert cli.main() == 0  # the command line's own process (the console script calls main())
    assert calls == [1]
    assert cli.main(["config-reference"]) == 0  # called from someone else's process
    assert calls == [1]
    assert cli.main(["config-reference"], own_process=True) == 0  # jobs.run, the Ray job's entry point
    assert calls == [1, 1]
