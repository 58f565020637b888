"""Prefect flows: the pipeline flow that runs a config's plan, and the embedded server.

Installed as ``posttrain.flows``; with ``tasks/`` the only code that imports Prefect. Prefect's file
entrypoint is ``flows/pipeline_flow.py:posttrain_pipeline`` (see ``prefect.yaml``).
"""
