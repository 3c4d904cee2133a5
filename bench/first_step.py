"""What a worker's first optimizer steps cost: torch.optim's against fedsim.training.optim's, each in a fresh process.

`python -m bench.first_step` prints, for each, the seconds and the RSS growth of three SGD steps of a small
model (torch.optim imports its compiler stack at its first step; fedsim.training.optim does not).
"""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys, time, psutil, torch
which = sys.argv[1]
m, x = torch.nn.Linear(100, 10), torch.randn(32, 100)
proc = psutil.Process()
rss, t = proc.memory_info().rss, time.perf_counter()
if which == "torch":
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
else:
    from fedsim.training.optim import SGD
    opt = SGD(m.parameters(), lr=0.1, momentum=0.9)
for _ in range(3):
    opt.zero_grad(); m(x).sum().backward(); opt.step()
print(f"{which}: {time.perf_counter() - t:.3f} s, +{(proc.memory_info().rss - rss) / 2**20:.0f} MB")
"""


def main() -> None:
    for which in ("torch", "fedsim", "torch", "fedsim"):
        subprocess.run([sys.executable, "-c", PROBE, which], check=True)


if __name__ == "__main__":
    main()
