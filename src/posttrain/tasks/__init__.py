"""Prefect @task wrappers around `posttrain.steps`: thin, no logic (see stages.py)."""
