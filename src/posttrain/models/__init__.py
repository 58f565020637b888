"""Models: resolving `model.name` (hub id, local directory, GGUF file, built-in), precision and
hardware checks, loading with adapter chains, and the files a stage leaves on disk.
"""
