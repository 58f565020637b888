"""Prefect tasks: thin wrappers that run one step of the plan (``posttrain.pipeline.plan``).

Installed as ``posttrain.tasks``; with ``flows/`` the only code that imports Prefect.
"""
