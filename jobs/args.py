"""Argument parsing shared by the commands: errors in one line, counts with bounds."""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2, like every other user error."""

    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other user error
        self.exit(2, f"{self.prog}: error: {message}\n")


def count(minimum: int, maximum: int | None = None):
    """argparse type: an integer >= minimum (and <= maximum, when given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse
