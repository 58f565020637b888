"""The managed vLLM server of one evaluation step (``eval.backend: vllm_server``).

The server is the same ``trl vllm-serve`` a GRPO stage in server mode gets
(:func:`posttrain.generation.vllm_server.vllm_server`, settings from ``vllm_server:``), but it
must serve the evaluated weights themselves: a GRPO stage's server may load the adapter chain's
base because TRL pushes the policy's weights into it before generating, while nothing is pushed
during evaluation. So a merged or full output is served from its folder, and an adapter output is
first merged onto its base into a scratch folder that lives as long as the server.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from posttrain.core.config import ModelConfig, VLLMServerConfig
from posttrain.generation.vllm_server import ServerAddress, check_vllm_server, vllm_server
from posttrain.models.artifacts import is_adapter_dir
from posttrain.models.loading import load_stage_model
from posttrain.models.resolve import resolve_model_path

logger = logging.getLogger(__name__)

__all__ = ["SERVER_LOG", "eval_server", "servable_model"]

SERVER_LOG = "vllm_server.log"
"""The server's output, kept in the evaluation's output folder."""


def servable_model(model_path: str, model_cfg: ModelConfig, scratch: Path) -> str:
    """A path or hub id vLLM can load with the weights of ``model_path``: the model itself, or for
    an adapter output the adapter chain merged onto its base, saved under ``scratch``."""
    if not is_adapter_dir(model_path):
        return resolve_model_path(model_path, model_cfg.cache_dir)
    model, tokenizer = load_stage_model(
        model_path, model_cfg.precision, model_cfg.cache_dir, revision=model_cfg.revision
    )
    merged = scratch / "merged"
    model.save_pretrained(merged)
    tokenizer.save_pretrained(merged)
    logger.info("vllm_server: serving %s merged onto its base as %s", model_path, merged)
    return str(merged)


@contextlib.contextmanager
def eval_server(
    server_cfg: VLLMServerConfig,
    model_cfg: ModelConfig,
    model_path: str,
    work_dir: str | Path,
    *,
    command: Sequence[str] | None = None,
) -> Iterator[tuple[ServerAddress, str]]:
    """Serve ``model_path`` while the block runs; yield the address and the served path.

    CUDA and vLLM are checked before an adapter is merged (``command`` replaces ``trl vllm-serve``
    and the check, for tests). The server's log is ``work_dir/vllm_server.log``; a merged copy goes
    to a scratch folder in ``work_dir`` that is removed with the server.
    """
    if command is None:
        check_vllm_server()
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="served-", dir=work_dir) as scratch:
        served = servable_model(model_path, model_cfg, Path(scratch))
        revision = model_cfg.revision if not Path(served).is_dir() else None
        with vllm_server(
            server_cfg, served, work_dir / SERVER_LOG, revision=revision, command=command
        ) as address:
            yield address, served
