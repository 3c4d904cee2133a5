"""Entry point that `ray job submit --working-dir . -- python -m jobs.run CONFIG` runs on a cluster.

Same arguments as `fedsim run`; inside a Ray job it joins the job's cluster (RAY_ADDRESS).
"""

from __future__ import annotations

import sys

from jobs.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]], own_process=True))
