"""posttrain.core.quiet: what a run's terminal leaves out, and what it prints once."""

from __future__ import annotations

import subprocess
import sys

import pytest

HUB_RETRY = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from posttrain.core.quiet import one_line_per_library_record
if sys.argv[1] == "fixed":
    one_line_per_library_record()
from huggingface_hub.utils import logging as hub_logging
hub_logging.get_logger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
"""


@pytest.mark.parametrize(("mode", "lines"), [("fixed", 1), ("as-is", 2)])
def test_a_hub_retry_is_printed_once_under_a_configured_root_logger(mode, lines):
    """The "as-is" row pins the library behaviour the function exists for: without it, each retry
    of an unreachable hub is printed twice, once by huggingface_hub's own handler."""
    err = subprocess.run(
        [sys.executable, "-c", HUB_RETRY, mode], capture_output=True, text=True, check=True, timeout=120
    ).stderr
    retries = [line for line in err.splitlines() if "Retrying in 1s" in line]
    assert len(retries) == lines, err
    assert retries[0] == "WARNING huggingface_hub.utils._http: Retrying in 1s [Retry 1/5]." or mode == "as-is"


def test_the_cli_prints_hub_records_through_the_root_logger_only():
    """The CLI's own logging setup is where the library's handler has to go (a launched stage's is
    posttrain.pipeline.stage_main, which calls the same function)."""
    code = (
        "import logging, huggingface_hub.utils.logging\n"
        "from posttrain.cli import main\n"
        "main(['config', 'seed'])\n"
        "print(len(logging.getLogger('huggingface_hub').handlers))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.splitlines()[-1] == "0"
