"""The process ``accelerate launch`` starts for one training stage (see posttrain.pipeline.launcher).

``python -m posttrain.pipeline.stage_main <request.json>``: every rank rebuilds the plan from the
request and runs the step's stage function, exactly as the in-process launcher would; the stage
itself (posttrain.training.stage_run) lets rank 0 alone prepare and write the output folder.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from posttrain.core.config import PipelineConfig
from posttrain.core.quiet import one_line_per_library_record, quiet_library_warnings
from posttrain.core.results import DataResult, ScoreResult
from posttrain.pipeline.plan import TrainStep, build_plan
from posttrain.pipeline.steps import ModelRef

logger = logging.getLogger(__name__)


def run_request(request: dict) -> None:
    """Train the request's step into its output folder (reporting to no tracker: the parent logs)."""
    cfg = PipelineConfig.model_validate(request["config"])
    step = build_plan(cfg).step(request["step"])
    assert isinstance(step, TrainStep), f"{step.name} is not a training step"
    data = DataResult(**request["data"])
    scored = {"scores": ScoreResult(**request["scores"])} if request.get("scores") else {}
    step.train(cfg, ModelRef(**request["model"]), data, request["output_dir"], "none", **scored)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m posttrain.pipeline.stage_main REQUEST.json\n")
        return 2
    rank = int(os.environ.get("RANK", "0"))
    # Rank 0 tells the story; the others only speak up when something is wrong.
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
    )
    quiet_library_warnings()
    one_line_per_library_record()
    if rank != 0:  # the same bars as rank 0's, a second time
        import datasets  # heavy: the stage imports both anyway
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    try:
        run_request(json.loads(Path(args[0]).read_text(encoding="utf-8")))
    finally:
        _leave_process_group()
    return 0


def _leave_process_group() -> None:
    """Destroy the stage's process group before the interpreter exits, as PyTorch asks: left to
    interpreter teardown, a rank's gloo threads can be destroyed while still joinable, and that rank
    aborts (SIGABRT, "terminate called without an active exception") after the stage has finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
