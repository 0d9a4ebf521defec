"""The doctor's output: lines under section headings, each problem found
also kept for the summary and the exit status."""
import sys


class Report:
    """Lines under section headings, and the problems found on the way."""

    def __init__(self, out=None):
        self.out = out  # None: sys.stdout as it is at each line
        self.problems = []

    def section(self, title):
        print(f"\n== {title}", file=self.out or sys.stdout)

    def line(self, key, value=""):
        print(f"{key}: {value}" if value != "" else key, file=self.out or sys.stdout)

    def problem(self, key, value):
        self.problems.append(f"{key}: {value}")
        self.line(key, f"PROBLEM: {value}")


def size_text(nbytes):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"

