"""Builds small random GPT-2 and Llama checkpoints with `transformers` (no weights can be
downloaded here) and records their next-token logits on fixed token ids, for the Rust side
(`tests/tests/integration/hugging_face.rs`) to compare the imported models' logits with.

Usage: python hf_reference.py OUT_DIR; prints a JSON object, one entry per checkpoint: its
directory, the token ids (each row one sequence) and the logits at each sequence's last step.
"""

import json
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB, LENGTH = 96, 12


def checkpoints():
    yield "gpt2", GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    )
    # Grouped-query attention (2 key/value heads for 4 query heads), an untied head.
    yield "llama_gqa", LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        )
    )
    # Plain multi-head attention, tied embeddings, the default rotary base.
    yield "llama_tied", LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=True,
        )
    )


def main():
    out_dir = sys.argv[1]
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(7))
    out = {}
    for name, model in checkpoints():
        # Random weights larger than the initializer's, so that every block matters.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        model.eval()
        path = f"{out_dir}/{name}"
        model.save_pretrained(path, safe_serialization=True)
        with torch.no_grad():
            logits = model(ids).logits[:, -1, :]
        out[name] = {"dir": path, "ids": ids.tolist(), "logits": logits.tolist()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
