"""The benchmark script runs to the end in its quick form and prints every figure.

Its timings are not checked here: speed is measured by running the script, never by a
test. What it prints beside them, the length of ``describe``, is.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_quick_benchmark_prints_every_figure() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/reset_bench.py", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )

    out = done.stdout
    for figure in (
        "speed-up over the per-tensor loop",
        "opttree.reset / bare foreach",
        "bandwidth ratio",
        "bytes allocated on cpu during a reset",
        "tree + validate",
        "us/tensor",
    ):
        assert figure in out, figure
    lines = re.search(r"describe +[\d.]+ ms, (\d+) lines", out)
    assert lines is not None and int(lines.group(1)) <= 60
