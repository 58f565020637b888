"""Scripted models for tests: one Llama layer whose next token depends only on the current token.

Imported by tests that need a model whose output they know (tests/ is on ``sys.path`` through its
conftest): the engine's tool tests script what a row writes, the pass-rate tests how often it is right.
"""

from __future__ import annotations

import math

import torch


def token_ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def bigram_model(tokenizer, successors: dict[int, int], default: int):
    """A one-layer Llama whose greedy next token depends only on the current token (``successors``,
    else ``default``): a scripted writer, so a test can make one row write ``12*7 =`` and another
    never write ``=``. The attention still runs (small random output), so rows share a real cache."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    vocab = len(tokenizer)
    width = ((vocab + 7) // 8) * 8
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.model.layers[0].self_attn.o_proj.weight.mul_(0.01)
        model.model.layers[0].mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.zero_()
        for token in range(vocab):
            head[successors.get(token, default), token] = 1.0
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def chain(tokenizer, *texts: str) -> dict[int, int]:
    """Successors that make the model write each text's tokens in order, then EOS."""
    successors: dict[int, int] = {}
    for text in texts:
        ids = token_ids(tokenizer, text) + [tokenizer.eos_token_id]
        for current, following in zip(ids, ids[1:], strict=False):
            assert successors.get(current, following) == following, f"{text!r} needs a second successor"
            successors[current] = following
    return successors


def answers_seven_mostly(tokenizer, after: str, p_seven: float, *, stop_on_eight: bool = False):
    """A model that, after the last token of ``after``, writes ``<answer>7</answer>`` with probability
    ``p_seven`` (at temperature 1) and ``<answer>8</answer>`` otherwise, whatever came before; a
    bigram model has no memory, so it then repeats ``answer>`` + digit + ``</`` up to the length limit
    (only the first ``<answer>`` opens a block, so the first digit is the answer).

    ``stop_on_eight``: every 8 ends the completion instead, so it answers 7 with probability
    ``p_seven`` (``<answer>7</answer>`` + more sevens + ``8``) and gives no answer block otherwise;
    a completion stops (not cut off at the limit) when an 8 comes soon enough."""
    t = tokenizer
    lt, word, gt = token_ids(t, "<answer>")
    close, seven, eight = token_ids(t, "</")[0], token_ids(t, "7")[0], token_ids(t, "8")[0]
    start = token_ids(t, after)[-1]
    successors = {start: lt, lt: word, word: gt, gt: seven, seven: close, eight: close, close: word}
    if stop_on_eight:
        del successors[eight]  # the default: the end-of-sequence token
    model = bigram_model(t, successors, default=t.eos_token_id)
    with torch.no_grad():  # the branch after '>': logit(8) - logit(7) = log((1 - p) / p)
        out = model(torch.tensor([[gt]]), output_hidden_states=True)
        scale = out.hidden_states[-1][0, -1, gt].item()  # what the final norm makes of the one-hot state
        head = model.lm_head.weight
        head[eight, gt] = head[seven, gt] + math.log((1 - p_seven) / p_seven) / scale
    return model
