"""``FUSEKERN_FAILURE_LOG``: each failure's report is in the log when the test has run, before the session ends."""
from __future__ import annotations

pytest_plugins = ["pytester"]


def test_failures_are_logged_as_they_happen(pytester, monkeypatch, tmp_path):
    log = tmp_path / "failures.txt"
    monkeypatch.setenv("FUSEKERN_FAILURE_LOG", str(log))
    pytester.makepyfile(test_inner=f"""
        import pathlib

        def test_a_fails():
            assert 1 + 1 == 3, "arithmetic"

        def test_b_passes():
            pass

        def test_c_sees_a_logged(request):  # (a later test of the same session: a was written when it failed)
            if hasattr(request.config, "workerinput"):
                return  # (under pytest-xdist the controller writes, at its own pace: checked after the run)
            text = pathlib.Path({str(log)!r}).read_text()
            assert "test_inner.py::test_a_fails (call)" in text and "arithmetic" in text
            assert "test_b_passes" not in text
    """)
    for workers in ([], ["-n", "2"]):  # in one process, and with pytest-xdist (each failure written once)
        log.unlink(missing_ok=True)
        result = pytester.runpytest("-p", "fusekern.testing.failure_log", "-p", "no:cacheprovider", *workers)
        result.assert_outcomes(passed=2, failed=1)
        text = log.read_text()
        assert text.count("=== ") == 1 and "AssertionError" in text, workers
