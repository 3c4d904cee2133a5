"""`python -m tests.parse_only MODULE ARGS...`: run `python -m MODULE ARGS...` only as far as its argument parsing.

The first `ArgumentParser.parse_args` call that succeeds prints `parsed` and exits 0, so a documented command's
flags and values are checked without the hours a benchmark or a reproduction takes; a bad argument exits 2 with
the command's own one-line error. A module that finishes without parsing anything exits 1.
"""

from __future__ import annotations

import argparse
import runpy
import sys

_parse_args = argparse.ArgumentParser.parse_args


def _parse_then_stop(self, args=None, namespace=None):
    _parse_args(self, args, namespace)
    print("parsed")
    raise SystemExit(0)


if __name__ == "__main__":
    module, sys.argv = sys.argv[1], sys.argv[1:]
    argparse.ArgumentParser.parse_args = _parse_then_stop  # type: ignore[method-assign]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(f"{module} ended without parsing its arguments")
