"""Loads what Starling exported of a LoRA run with Hugging Face's own libraries: its PEFT
adapters onto the checkpoint the run started from, and its merged checkpoint alone; prints
both models' next-token logits on the given token ids (`tests/tests/integration/hugging_face.rs`).

Usage: python peft_check.py BASE_DIR PEFT_DIR MERGED_DIR IDS_JSON
"""

import json
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def main():
    base_dir, peft_dir, merged_dir, ids = sys.argv[1:5]
    ids = torch.tensor(json.loads(ids))
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, peft_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = {
            "peft": adapted(ids).logits[:, -1, :].tolist(),
            "merged": merged(ids).logits[:, -1, :].tolist(),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
