"""The pipeline layer: a typed plan of steps built from a config, what each step runs, how a
training stage is launched, and config loading with every check the lower layers allow.

No Prefect here: ``flows/`` and ``tasks/`` run this plan under Prefect; ``--dry-run`` prints it.
"""

from posttrain.pipeline.validation import load_config

__all__ = ["load_config"]
