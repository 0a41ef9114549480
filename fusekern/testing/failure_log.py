"""A pytest plugin: ``FUSEKERN_FAILURE_LOG=PATH`` appends each failing test's report to PATH as soon as it fails.

Why: the GPU machine's calls run under a time limit that kills pytest before its summary, and with
pytest-xdist the failures' tracebacks are printed only there; this log keeps those that failed until then.
Under pytest-xdist only the controller writes (the workers' reports reach it; a worker's config has
``workerinput``), so each failure is written once.
"""
from __future__ import annotations

import os


class _FailureLog:
    def __init__(self, path: str):
        self.path = path

    def pytest_runtest_logreport(self, report):
        if report.failed:
            with open(self.path, "a") as log:
                log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


def pytest_configure(config):
    path = os.environ.get("FUSEKERN_FAILURE_LOG")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_FailureLog(path), "fusekern_failure_log_writer")
