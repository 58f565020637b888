"""One rank of tests/system/test_launcher_multiprocess.py's FSDP2 save test (``torchrun --nproc_per_node 2``).

``python fsdp2_save_worker.py MODEL_DIR OUT_DIR``: for a full fine-tune and for LoRA (saved merged
and as an adapter), every rank loads the model, keeps a whole copy, shards the other with torch's
``fully_shard`` (one shard unit per decoder layer, then the root: what accelerate's FSDP2
``TRANSFORMER_BASED_WRAP`` does) and takes the same SGD step on both with the same batch; then it
does what a stage does after training (:func:`posttrain.training.sharded.policy_to_save` on every
rank, :func:`posttrain.models.artifacts.save_policy` on rank 0). Rank 0 also saves the whole copy;
the test compares the two folders. accelerate cannot run FSDP on a CPU, so no trainer here.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.models.artifacts import save_policy
from posttrain.training.sharded import policy_to_save

CASES = (("full", None), ("merged", "merge"), ("adapter", "adapter"))  # (folder, adapter_policy)


def train_step(model) -> None:
    ids = torch.arange(3, 19).reshape(2, 8)  # the same batch on every rank
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()


def main(model_dir: str, out: Path) -> None:
    accelerator = Accelerator(cpu=True)  # joins the gloo group torchrun describes
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for folder, policy in CASES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        if policy is not None:
            lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
            model = get_peft_model(model, lora)
        whole = copy.deepcopy(model)
        layers = model.get_base_model().model.layers if policy else model.model.layers
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        train_step(model)
        train_step(whole)
        saved = policy_to_save(model, accelerator)
        if accelerator.is_main_process:
            save_policy(saved, tokenizer, out / folder / "sharded", adapter_policy=policy or "merge")
            save_policy(whole, tokenizer, out / folder / "whole", adapter_policy=policy or "merge")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
