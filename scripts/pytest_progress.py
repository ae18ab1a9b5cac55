"""A pytest plugin for scripts/gpu_check.py: every test's outcome written to a JSON file as it finishes.

    pytest -p pytest_progress --progress-json PATH ...      (scripts/ on PYTHONPATH)

junit XML is written only when the session ends; a run that its time limit kills leaves nothing. This
file is rewritten after each test, so a cut run still says what passed, what failed and why, and
the properties a test recorded (`record_property`).
"""

import json
import os
import time


def pytest_addoption(parser):
    parser.addoption("--progress-json", default=None, help="rewrite this JSON file after every test")


def pytest_configure(config):
    path = config.getoption("--progress-json")
    if path:
        config.pluginmanager.register(_Progress(path), "gpu_check_progress")


class _Progress:
    def __init__(self, path: str):
        self.path, self.tests, self.start = path, {}, time.time()
        self._write(finished=False)

    def pytest_runtest_logreport(self, report):
        test = self.tests.setdefault(report.nodeid, dict(name=report.nodeid, outcome="passed", seconds=0.0,
                                                         properties={}, message=None))
        test["seconds"] = round(test["seconds"] + report.duration, 2)
        test["properties"].update(dict(report.user_properties))
        if report.skipped and test["outcome"] == "passed":
            test["outcome"] = "skipped"
            test["message"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else None
        elif report.failed:
            test["outcome"] = "failed" if report.when == "call" else "error"
            test["message"] = str(report.longrepr)[-1500:]
        if report.when == "teardown":
            self._write(finished=False)

    def pytest_sessionfinish(self, session, exitstatus):
        self._write(finished=True, exitstatus=int(exitstatus))

    def _write(self, *, finished: bool, exitstatus=None):
        tests = list(self.tests.values())
        counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
        record = dict(finished=finished, exitstatus=exitstatus, seconds=round(time.time() - self.start, 1),
                      counts=counts, tests=tests)
        with open(self.path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(self.path + ".tmp", self.path)
