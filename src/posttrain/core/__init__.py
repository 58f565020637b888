"""The lowest layer: config schema, TRL option checks, errors, GSM8K records and prompts, THE answer
parser, hashing and atomic writes. Pure Python plus pydantic/yaml: no torch, TRL, Prefect or MLflow.
"""
