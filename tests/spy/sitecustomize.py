"""Installs the step spy (step_spy.py) in the processes multiprocessing spawns while a test watches
steps: Prefect's process-pool task runner starts its workers this way. This folder is on
PYTHONPATH only while such a test runs (tests/conftest.py: step_spy)."""

import os
import sys

if os.environ.get("POSTTRAIN_TEST_STEP_SPY") and "spawn_main" in " ".join(getattr(sys, "orig_argv", ())):
    import step_spy

    step_spy.install(os.environ["POSTTRAIN_TEST_STEP_SPY"])
