"""posttrain: reproducible post-training of small language models for verifiable reasoning."""

__version__ = "0.1.0"
