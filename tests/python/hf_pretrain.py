"""Pretrains a small Llama-architecture model centrally, as a Hugging Face user would, for the
`hf_fine_tuning` benchmark: a byte-level BPE tokenizer and the model trained on the given text
(next-token loss at every position), saved with `save_pretrained` beside its `tokenizer.json`.

Usage: python hf_pretrain.py TEXT_FILE OUT_DIR STEPS; prints a JSON summary.
"""

import json
import sys
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

LENGTH, BATCH = 32, 64


def main():
    text_file, out_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(2)
    torch.manual_seed(0)
    with open(text_file, encoding="utf-8") as f:
        text = f.read()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    tok.save(f"{out_dir}/tokenizer.json")
    ids = torch.tensor(tok.encode(text).ids)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    started = time.time()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - LENGTH, (BATCH,))
        x = torch.stack([ids[s : s + LENGTH] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.save_pretrained(out_dir, safe_serialization=True)
    print(json.dumps({
        "tokens": len(ids),
        "vocab": tok.get_vocab_size(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": steps,
        "loss": sum(losses[-50:]) / min(50, len(losses)),
        "seconds": time.time() - started,
    }))


if __name__ == "__main__":
    main()
