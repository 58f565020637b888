"""One generation engine for every place posttrain samples from a model: evaluation, DPO's on-policy
sampling and GRPO's rollouts (KV cache, continuous batching, sampling, the bf16 shadow policy, vLLM).

torch is imported at module level here: every caller is about to run a model anyway.
"""
