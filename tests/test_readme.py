"""Every ```python block in README.md runs (each in its own interpreter, as a reader would paste it)."""
import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def python_blocks() -> list[str]:
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_has_python_blocks():
    assert len(python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_block_runs(index):
    code = python_blocks()[index]
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"README block {index} failed:\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"


def test_result_tables_are_the_csvs():
    """The result tables of README.md and docs/results-h200.md are generated from benchmarks/results
    (benchmarks/results_tables.py), and every table the script knows sits in one of them, once."""
    root = os.path.join(os.path.dirname(__file__), "..")
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "results_tables.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    from results_tables import DOCS, TABLES

    text = ""
    for path in DOCS:
        with open(path) as f:
            text += f.read()
    names = re.findall(r"<!-- results:(\w+) -->", text)
    assert sorted(names) == sorted(TABLES)
