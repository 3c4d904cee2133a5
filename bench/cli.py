"""The bench programs' argument parser: a bad argument is one line on stderr and exit code 2, as everywhere in
fedsim. Only the standard library, so a program's start-up timing does not change by importing it."""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse without the usage line before an error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")
