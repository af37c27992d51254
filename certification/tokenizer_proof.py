"""Proof that a module-side tokenizer equals llama.cpp's own tokenization of a GGUF.

The host tokenizes (with HF `tokenizers`) and llama.cpp only sees ids, so for a model that
arrives as a GGUF the tokenizer derived from its vocabulary must give llama.cpp's ids for
every text, or the served model is not the model. The proof runs at ingest on the fixed
certification corpus (every script, emoji, code, long inputs) plus edge cases, sanitized as
the host sanitizes every input, with and without the special tokens; llama.cpp answers from
a child process (`workers.llama.vocab_probe`). Any difference refuses the model, naming the
first text that differs.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers

from certification.corpus import corpus
from host.sanitize import sanitize
from ingest.errors import TokenizerMismatch
from workers.llama.vocab_probe import ProbeFailed, tokenize_with_llama

# Edges the corpus does not stress: spacing, case, accents, marks, format characters,
# special-token strings written as text, symbols and ligatures.
EDGE_TEXTS = (
    "",
    " ",
    "  lots   of\tspace\n\nand lines\r\n",
    "Hello, World!",
    "HELLO world",
    "naïve café résumé",
    "nai\u0308ve cafe\u0301",
    "İstanbul ΣΟΦΙΑ straße",
    "Ǆemal ﬁne Ⅻ",
    "[CLS] text [SEP] <s> </s> <unk>",
    "a\u200db\u00adc\ufeffd",
    "ab$cd+ef<gh>=ij^k`l|m~",
    "日本語のテキスト",
    "고양이가 창가에서 자고 있습니다",
    "नमस्ते दुनिया",
    "🙂👍🏽 ❤️",
    "x" * 300,
    "word " * 50,
)


def proof_texts() -> list[str]:
    return [sanitize(t) for t in (*corpus(), *EDGE_TEXTS)]


def prove_gguf_tokenizer(gguf: str | Path, tokenizer_json: str | Path) -> int:
    """Raise TokenizerMismatch unless `tokenizer_json` tokenizes like llama.cpp does with
    `gguf`'s vocabulary; returns how many texts were compared."""
    texts = proof_texts()
    try:
        llama = tokenize_with_llama(gguf, texts)
    except ProbeFailed as e:
        raise TokenizerMismatch(f"llama.cpp could not tokenize with this vocabulary: {e}") from e
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True  # special-token strings in text are text (the host's rule)
    for add_special, key in ((True, "special"), (False, "plain")):
        ours = tok.encode_batch(texts, add_special_tokens=add_special)
        for i, (enc, ref) in enumerate(zip(ours, llama, strict=True)):
            if enc.ids != ref[key]:
                pairs = zip(enc.ids, ref[key], strict=False)  # the shorter one ends the walk
                at = next(
                    (k for k, (a, b) in enumerate(pairs) if a != b),
                    min(len(enc.ids), len(ref[key])),
                )
                raise TokenizerMismatch(
                    f"the tokenizer derived from {Path(gguf).name} differs from llama.cpp's on "
                    f"text {i} ({texts[i][:40]!r}, {'with' if add_special else 'without'} "
                    f"special tokens) at token {at}: {enc.ids[at : at + 5]} vs "
                    f"{ref[key][at : at + 5]}; refusing a model that would be tokenized "
                    "differently from llama.cpp"
                )
    return len(texts)
