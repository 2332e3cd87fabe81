"""Trains four tokenizers of the shapes Hugging Face checkpoints ship with on Shakespeare's
text and records what Python's `tokenizers` makes of test strings, for the Rust side
(`tests/tests/integration/tokenizers.rs`) to compare its own ids with.

Usage: python tokenizers_reference.py TEXT_FILE OUT_DIR; prints a JSON object, one entry per
tokenizer: its file, its vocabulary bound (largest id + 1) and each test string's ids.
"""

import json
import sys

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# Strings that exercise what tokenizers get wrong: accents and case, runs of spaces, tabs and
# newlines, contractions, numbers, CJK, emoji (bytes outside the training text), special-token
# literals, and the empty string.
SAMPLES = [
    "To be, or not to be: that is the question.",
    "  Whether 'tis nobler   in the mind\tto suffer\n\nThe slings and arrows",
    "Café naïve résumé — ÉLAN",
    "I'll, you're, we've, don't, she's; 1603 and 3.14159",
    "日本語のテキスト and 中文",
    "emoji 🎭🗡️ and a ZWJ 👩‍👩‍👧",
    "[CLS] <s> </s> [UNK] <unk>",
    "",
    "ROMEO. O, she doth teach the torches to burn bright!",
]


def byte_level_bpe(text):
    """GPT-2's shape: byte-level pre-tokenizer (its regex), BPE over bytes, no normalizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text], trainer)
    return tok


def sentencepiece_bpe(text):
    """Llama's shape: ▁ for spaces, BPE with byte fallback, <s> added in front."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials)
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def wordpiece(text):
    """BERT's shape: lower-casing, accent-stripping normalizer, [CLS] … [SEP]."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=500, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    )
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    return tok


def unigram(text):
    """T5's shape: NFKC, Metaspace, a Unigram model."""
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    tok.train_from_iterator(text.splitlines(), trainer)
    return tok


def main():
    text_file, out_dir = sys.argv[1], sys.argv[2]
    with open(text_file, encoding="utf-8", errors="replace") as f:
        text = f.read()[:300_000]
    out = {}
    for name, make in [
        ("byte_level_bpe", byte_level_bpe),
        ("sentencepiece_bpe", sentencepiece_bpe),
        ("wordpiece", wordpiece),
        ("unigram", unigram),
    ]:
        tok = make(text)
        path = f"{out_dir}/{name}.json"
        tok.save(path)
        # Loaded back from the file, as the Rust side loads it.
        tok = Tokenizer.from_file(path)
        out[name] = {
            "file": path,
            "vocab_bound": max(tok.get_vocab(with_added_tokens=True).values()) + 1,
            "ids": [tok.encode(s).ids for s in SAMPLES],
        }
    out["samples"] = SAMPLES
    print(json.dumps(out))


if __name__ == "__main__":
    main()
