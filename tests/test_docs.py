"""The docs a user meets first: what `posttrain --help` says."""

from __future__ import annotations

import pytest

from posttrain.cli import main


def test_help_opens_by_saying_what_posttrain_does(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]  # after the usage block
    assert description.startswith("Post-train small language models for verifiable reasoning")
    assert "only module that prints" not in out  # the module's note to developers stays in the module
    assert "posttrain run configs/smoke.yaml" in out
