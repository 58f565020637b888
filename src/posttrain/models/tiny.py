"""A tiny random causal LM with a real tokenizer and chat template, built offline in seconds.

It is the built-in model `tiny-random`: the smoke config and the test suite train it, so every
stage (SFT, DPO, GRPO, evaluation) runs end to end without a hub or a download. Its outputs are
noise; what it proves is the plumbing: chat templating, padding, LoRA, saving and reloading.

The tokenizer is a byte-level BPE trained on a fixed corpus (the XML answer format, digits and
GSM8K-like words), so any text round-trips and the build is deterministic.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "tiny-random"

# ChatML, as SmolLM2 and Qwen2.5 use; `{% generation %}` marks assistant text for TRL's
# assistant_only_loss.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "<reasoning>\nFirst compute the total. Then subtract what was spent.\n</reasoning>\n<answer>\n42\n</answer>",
    "Respond in the following format: reasoning inside tags, then the final number inside answer tags.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? She earned $12 an hour for 50 minutes.",
    "A baker makes 3 trays of 24 cookies each day. Each box holds 6 cookies. How many boxes per week?",
    "The store sells apples for 2 dollars each and pears at 25% off. Tom drives 60 miles per hour.",
    "0 1 2 3 4 5 6 7 8 9 10 12 15 20 24 36 48 72 100 1,000 + - * / = % $ . , ? ! : ( )",
    "system user assistant total each many much more less than times half twice left remaining",
]


def build_tiny_tokenizer():
    """A deterministic byte-level BPE tokenizer (~400 tokens) with a ChatML template."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )  # heavy: deferred until needed
    from transformers import PreTrainedTokenizerFast  # heavy: deferred until needed

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token=None,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(output_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random Llama (2 layers, width 64) and its tokenizer to ``output_dir``."""
    import torch  # heavy: deferred until needed
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # heavy: deferred until needed

    output_dir = Path(output_dir)
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    logger.info("built tiny random model in %s (%d parameters)", output_dir, model.num_parameters())
    return output_dir
