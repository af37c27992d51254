"""Derive a HF `tokenizer.json` from a GGUF file's own vocabulary.

The host tokenizes module-side and must never import llama_cpp, so for GGUF models the
tokenizer is rebuilt at ingest from the vocabulary stored in the GGUF itself and saved as a
plain `tokenizer.json` (HF `tokenizers`). Ingest proves every derived tokenizer equal to
llama.cpp's own tokenization (`certification/tokenizer_proof.py`); `tests/test_gguf_vocab.py`
and `tests/test_gguf_ingest.py` do so on the corpus.

Supported: `tokenizer.ggml.model` "bert" (WordPiece: `_build_wpm`), "t5" (Unigram:
`_build_ugm`), "gpt2" with a pre-tokenizer of `BPE_PRE_TOKENIZERS` (`_build_bpe`), and
"llama" (SentencePiece-style vocab with scores and token types: Llama 1/2, Mistral, Gemma
1-3). How llama.cpp tokenizes a "llama" vocab, and how each step is reproduced here:

1. Special-token partition on the RAW text (before any escaping). USER_DEFINED tokens (Gemma:
   runs of spaces/newlines/tabs, HTML tags) are always split out; CONTROL/UNKNOWN tokens only
   when `special=True`. -> HF added tokens with `normalized=False`: user-defined ones as
   non-special, control/unknown ones as special; HF's `encode_special_tokens = True` is then
   exactly llama.cpp's `special=False` (`host.tokenization.Tokenizer(parse_special=False)`).
   Token types are first corrected the way llama.cpp corrects them at load (`effective_types`:
   e.g. Gemma 3's "</s>" is USER_DEFINED in the file but a control token in llama.cpp).
2. Each remaining text fragment: optional "▁" prefix (`add_space_prefix`, per fragment that
   follows a special token, like HF's per-split normalization), then every " " -> "▁".
   -> normalizers Prepend + Replace. (Gemma 3 has add_space_prefix = false; the prefix path
   is implemented from llama.cpp's rule but not proven on a model here.)
3. SPM merging: start from UTF-8 characters, repeatedly merge the adjacent pair whose
   concatenation is a vocab token with the highest score (ties: leftmost). -> BPE whose merge
   list is every (left, right) split of every vocab token where both halves are tokens,
   ranked by the merged token's score (descending). For a vocab whose scores are unique (Gemma
   3's normal tokens are) the two procedures pick the same merge at every step.
4. Leftover characters that are not tokens become `<0xNN>` byte tokens. -> `byte_fallback`.
5. BOS/EOS from `add_bos_token` / `add_eos_token`. -> TemplateProcessing.

Decoding mirrors llama.cpp's `llama_detokenize`: "▁" -> " ", byte tokens -> bytes, control
tokens dropped with `skip_special_tokens=True` (rendered with False).

Known, unproven corners (none occurs in Gemma 3): UNUSED-type tokens (llama.cpp never renders
them; HF would render their text); equal-score merge ties between different tokens (llama.cpp
breaks them by position, BPE by rank); model names for which llama.cpp adds strip attributes
(Phi-3) are refused rather than approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from formats.gguf_header import GGUFFormatError, read_gguf_header

# llama.cpp's `llama_token_type` values as stored in `tokenizer.ggml.token_type`.
TYPE_NORMAL = 1
TYPE_UNKNOWN = 2
TYPE_CONTROL = 3
TYPE_USER_DEFINED = 4
TYPE_UNUSED = 5
TYPE_BYTE = 6

SPACE_ESCAPE = "\u2581"  # "▁", SentencePiece's visible space


class UnsupportedVocab(ValueError):
    """The GGUF's tokenizer model is one this module cannot reproduce faithfully."""


@dataclass(frozen=True)
class GGUFVocab:
    model: str
    tokens: list[str]
    scores: np.ndarray  # float32, one per token
    types: np.ndarray  # int32, llama_token_type per token
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    name: str = ""  # general.name: llama.cpp keys a few per-model token attributes on it
    # WordPiece ("bert") vocabularies: the separator llama.cpp appends, and BertNormalizer's
    # options (llama.cpp's defaults: lowercase, and strip accents when lowercasing).
    sep_id: int | None = None
    # Whether llama.cpp puts the separator between the two texts of a rerank pair (its
    # default: WordPiece vocabularies only).
    add_sep: bool = False
    lowercase: bool = True
    strip_accents: bool = True
    # Unigram ("t5") vocabularies: SentencePiece's normalizer (its precompiled character map)
    # and whitespace options.
    charsmap: bytes = b""
    remove_extra_whitespaces: bool = False
    # Byte-level BPE ("gpt2") vocabularies: the merges and the pre-tokenizer's name.
    merges: tuple[str, ...] = ()
    pre: str = ""

    @classmethod
    def read(cls, gguf_path: str | Path) -> GGUFVocab:
        fields = read_gguf_metadata(gguf_path)

        def get(key: str, default: object = None) -> object:
            return fields.get(key, default)

        model = str(get("tokenizer.ggml.model", ""))
        tokens = list(cast("list[str]", get("tokenizer.ggml.tokens", [])))
        n = len(tokens)
        scores = np.asarray(get("tokenizer.ggml.scores", [0.0] * n), dtype=np.float32)
        types = np.asarray(get("tokenizer.ggml.token_type", [TYPE_NORMAL] * n), dtype=np.int32)

        def opt_id(key: str) -> int | None:
            value = get(key)
            return None if value is None else int(value)  # type: ignore[call-overload]

        return cls(
            model=model,
            tokens=tokens,
            scores=scores,
            types=types,
            bos_id=opt_id("tokenizer.ggml.bos_token_id"),
            eos_id=opt_id("tokenizer.ggml.eos_token_id"),
            unk_id=opt_id("tokenizer.ggml.unknown_token_id"),
            # llama.cpp's defaults when the keys are absent: SPM adds BOS and a space prefix,
            # Unigram (t5) adds EOS only and no prefix, byte-level BPE (gpt2) neither.
            add_bos=bool(get("tokenizer.ggml.add_bos_token", model not in ("t5", "gpt2"))),
            add_eos=bool(get("tokenizer.ggml.add_eos_token", model == "t5")),
            add_space_prefix=bool(
                get("tokenizer.ggml.add_space_prefix", model not in ("t5", "gpt2"))
            ),
            name=str(get("general.name", "")),
            sep_id=opt_id("tokenizer.ggml.seperator_token_id"),
            add_sep=bool(get("tokenizer.ggml.add_sep_token", model == "bert")),
            charsmap=bytes(
                np.asarray(get("tokenizer.ggml.precompiled_charsmap", []), dtype=np.uint8)
            ),
            remove_extra_whitespaces=bool(get("tokenizer.ggml.remove_extra_whitespaces", False)),
            merges=tuple(get("tokenizer.ggml.merges", ())),  # type: ignore[arg-type]
            pre=str(get("tokenizer.ggml.pre", "")),
            lowercase=bool(get("tokenizer.ggml.normalizer.lowercase", True)),
            strip_accents=bool(
                get(
                    "tokenizer.ggml.normalizer.strip_accents",
                    get("tokenizer.ggml.normalizer.lowercase", True),
                )
            ),
        )


_VOCAB_ARRAYS = frozenset(
    {
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.precompiled_charsmap",
        "tokenizer.ggml.merges",
    }
)


def read_gguf_metadata(path: str | Path) -> dict[str, object]:
    """The GGUF's key/value metadata with the vocabulary arrays read (the host's one fast,
    bounds-checked header scanner; `gguf.GGUFReader` takes tens of seconds on 262k tokens)."""
    try:
        return read_gguf_header(path, want_arrays=_VOCAB_ARRAYS).kv
    except GGUFFormatError as exc:
        raise UnsupportedVocab(f"not a readable GGUF: {exc}") from None


def spm_merges(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every (left, right) split of every token whose halves are both tokens, in SPM order.

    llama.cpp merges by the score of the merged token; BPE merges by rank, so rank = order of
    the merged token's score (descending), ties by token id (only the -1000 control/user
    tokens and the 0.0 byte tokens tie in Gemma 3, and those never compete in practice).
    """
    index = {text: i for i, text in enumerate(tokens)}
    order = sorted(range(len(tokens)), key=lambda i: (-float(scores[i]), i))
    merges: list[tuple[str, str]] = []
    for i in order:
        text = tokens[i]
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in index and right in index:
                merges.append((left, right))
    return merges


# llama.cpp does not take the GGUF's token types as final: at load it forces the CONTROL
# attribute onto tokens whose TEXT looks like an end-of-turn / end-of-generation / FIM marker
# (llama-vocab.cpp, "auto-detect special tokens by text"). Gemma 3 is affected: its "</s>" is
# a USER_DEFINED token (an HTML strike-through tag) that llama.cpp turns into a control token,
# so with `special=False` it is NOT split out of text, and it detokenizes to nothing.
# (llama.cpp assigns the EOT/EOM/FIM roles to the first match only; every vocabulary seen
# here has at most one candidate per role, and all EOT candidates are EOG candidates anyway.)
_FORCED_CONTROL = frozenset(
    {
        # end of turn / generation
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "[e~[",
        # fill-in-the-middle
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<\uff5cfim\u2581begin\uff5c>",
        "<PRE>",
        "\u2581<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<\uff5cfim\u2581hole\uff5c>",
        "<SUF>",
        "\u2581<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<\uff5cfim\u2581end\uff5c>",
        "<MID>",
        "\u2581<MID>",
        "<|code_middle|>",
        "<|middle|>",
        "<|fim_pad|>",
        "<fim-pad>",
        "<fim_pad>",
        "<PAD>",
        "[PAD]",
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
        "<|file_sep|>",
    }
)
# ... and it forces these to USER_DEFINED (always split out, always rendered).
_FORCED_USER = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})
# Model names for which llama.cpp adds per-token strip attributes we do not reproduce.
_REFUSED_NAMES = ("phi-3", "phi3")


def effective_types(vocab: GGUFVocab) -> list[int]:
    """Token types as llama.cpp's tokenizer actually treats them after its load-time fixes."""
    kinds = vocab.types.tolist()
    present = {text: i for i, text in enumerate(vocab.tokens)}
    for text in _FORCED_CONTROL & present.keys():
        if kinds[present[text]] != TYPE_UNKNOWN:
            kinds[present[text]] = TYPE_CONTROL
    for text in _FORCED_USER & present.keys():
        kinds[present[text]] = TYPE_USER_DEFINED
    # o200k_harmony / solar-open: "<|end|>" is demoted back when the turn markers exist.
    has_call = "<|call|>" in present or "<|calls|>" in present
    if "<|end|>" in present and has_call and ("<|return|>" in present or "<|flush|>" in present):
        kinds[present["<|end|>"]] = TYPE_USER_DEFINED
    # gemma4 / plamo: there "</s>" is an ordinary token.
    if "</s>" in present and ("<|tool_response>" in present or "<|plamo:eos|>" in present):
        kinds[present["</s>"]] = TYPE_NORMAL
    return kinds


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """A HF `Tokenizer` reproducing llama.cpp's tokenization of this vocabulary.

    Every failure is an `UnsupportedVocab` with a one-line reason: the `tokenizers` library
    raises plain exceptions (a template naming an undeclared token, a bad regex), which are
    refusals of this vocabulary, not crashes of ingest."""
    try:
        return _build(vocab)
    except UnsupportedVocab:
        raise
    except Exception as e:  # tokenizers raises untyped errors from Rust
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UnsupportedVocab(
            f"the {vocab.model or 'unnamed'} vocabulary's tokenizer could not be built: {reason}"
        ) from None


def _build(vocab: GGUFVocab) -> Tokenizer:
    if len(set(vocab.tokens)) != len(vocab.tokens):
        # llama.cpp's text->id map keeps the last duplicate; a dict-based vocab cannot say so.
        raise UnsupportedVocab("duplicate token texts in the GGUF vocabulary")
    if vocab.model == "llama":
        return _build_spm(vocab)
    if vocab.model == "bert":
        return _build_wpm(vocab)
    if vocab.model == "t5":
        return _build_ugm(vocab)
    if vocab.model == "gpt2" and vocab.pre in BPE_PRE_TOKENIZERS:
        return _build_bpe(vocab)
    what = (
        f"tokenizer.ggml.model={vocab.model!r}"
        if vocab.model != "gpt2"
        else f"byte-level BPE with pre-tokenizer {vocab.pre!r}"
    )
    raise UnsupportedVocab(
        f"{what}: derived are SentencePiece ('llama'), WordPiece ('bert'), Unigram ('t5') and "
        f"byte-level BPE with the {', '.join(sorted(BPE_PRE_TOKENIZERS))} pre-tokenizers; "
        "this one is not yet, so the model is refused rather than tokenized differently from "
        "llama.cpp"
    )


def _build_spm(vocab: GGUFVocab) -> Tokenizer:
    if any(n in vocab.name.lower() for n in _REFUSED_NAMES):
        raise UnsupportedVocab(
            f"{vocab.name!r}: llama.cpp strips spaces around its special "
            "tokens by model name; not reproduced, so refused"
        )
    known = set(vocab.tokens)
    missing_bytes = [b for b in range(256) if f"<0x{b:02X}>" not in known]
    if missing_bytes:
        raise UnsupportedVocab(f"no byte-fallback tokens for {len(missing_bytes)} byte values")

    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    model = models.BPE(
        vocab={text: i for i, text in enumerate(vocab.tokens)},
        merges=spm_merges(vocab.tokens, vocab.scores),
        unk_token=unk,
        byte_fallback=True,
        fuse_unk=False,
        ignore_merges=False,  # llama.cpp never short-cuts a whole-word vocab hit
    )
    tok = Tokenizer(model)

    steps: list[normalizers.Normalizer] = []
    if vocab.add_space_prefix:
        steps.append(normalizers.Prepend(SPACE_ESCAPE))
    steps.append(normalizers.Replace(" ", SPACE_ESCAPE))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = None  # SPM sees each fragment whole: no pre-splitting

    _add_vocabulary_tokens(tok, vocab.tokens, effective_types(vocab))

    tok.post_processor = _template(vocab)
    tok.decoder = _decoder(vocab)
    return tok


# llama.cpp's WPM pre-tokenizer (llm_tokenizer_wpm_session::preprocess) isolates punctuation
# (\p{P}), ASCII symbols and CJK ideographs (its is_chinese_char ranges, 0x2B920 quirk kept).
_WPM_ISOLATED = (
    r"[\p{P}\x{21}-\x{2F}\x{3A}-\x{40}\x{5B}-\x{60}\x{7B}-\x{7E}"
    r"\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}"
    r"\x{2B740}-\x{2B81F}\x{2B920}-\x{2CEAF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}]"
)
# ... drops U+0000, U+FFFD and \p{C} that is not whitespace (its whitespace set is Unicode's
# White_Space, which the split below uses too) ...
_WPM_DROPPED = r"[\x{0}\x{FFFD}]|(?![\t\n\v\f\r\x{85}])\p{C}"
# ... and, when stripping accents, maps each code point to the FIRST code point of its NFD
# (unicode_cpts_normalize_nfd is a 1:1 table) and drops every \p{M}. For all but the Hangul
# syllables that equals NFD then dropping \p{M} (checked over every code point); a syllable
# keeps only its initial consonant, which the per-block replacements below reproduce.
_HANGUL_FIRST, _HANGUL_PER_INITIAL, _HANGUL_INITIALS = 0xAC00, 21 * 28, 19


def _hangul_initials() -> list[normalizers.Normalizer]:
    out: list[normalizers.Normalizer] = []
    for lead in range(_HANGUL_INITIALS):
        lo = _HANGUL_FIRST + lead * _HANGUL_PER_INITIAL
        hi = lo + _HANGUL_PER_INITIAL - 1
        out.append(normalizers.Replace(Regex(f"[\\x{{{lo:X}}}-\\x{{{hi:X}}}]"), chr(0x1100 + lead)))
    return out


def _build_wpm(vocab: GGUFVocab) -> Tokenizer:
    """llama.cpp's WordPiece: a word is "▁" + word matched greedily longest-first, the GGUF
    storing word-initial pieces with "▁" and continuations bare (HF's "##"); a word with no
    full match becomes [UNK]; [CLS] ... [SEP] around (add_special)."""
    if vocab.bos_id is None or vocab.sep_id is None or vocab.unk_id is None:
        raise UnsupportedVocab(
            "a WordPiece vocabulary needs bos ([CLS]), separator and unknown token ids"
        )
    kinds = effective_types(vocab)
    wordpiece: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(vocab.tokens, kinds, strict=True)):
        if kind in (TYPE_CONTROL, TYPE_UNKNOWN, TYPE_USER_DEFINED):
            key = text  # added tokens below, matched before the model
        elif text.startswith(SPACE_ESCAPE):
            key = text[len(SPACE_ESCAPE) :]
            if not key:  # a bare "▁" piece: llama.cpp may match it where HF cannot
                raise UnsupportedVocab("a bare word-start piece (\u2581) is not reproduced")
        else:
            key = "##" + text
        if key in wordpiece:
            raise UnsupportedVocab(f"two GGUF tokens map to the WordPiece piece {key!r}")
        wordpiece[key] = i
    tok = Tokenizer(
        models.WordPiece(
            vocab=wordpiece,
            unk_token=vocab.tokens[vocab.unk_id],
            continuing_subword_prefix="##",
            max_input_chars_per_word=1 << 30,
        )
    )  # llama.cpp has no per-word length limit
    steps: list[normalizers.Normalizer] = []
    if vocab.strip_accents:
        steps += [*_hangul_initials(), normalizers.NFD()]
    if vocab.lowercase:
        # Before the mark removal: NFD+lowercase then dropping \p{M} equals llama.cpp's
        # per-code-point simple lowercase of the base letter (e.g. U+0130).
        steps.append(normalizers.Lowercase())
    if vocab.strip_accents:
        steps.append(normalizers.Replace(Regex(r"\p{M}"), ""))
    steps.append(normalizers.Replace(Regex(_WPM_DROPPED), ""))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(_WPM_ISOLATED), behavior="isolated"),
        ]
    )
    _add_vocabulary_tokens(tok, vocab.tokens, kinds)
    cls_text, sep_text = vocab.tokens[vocab.bos_id], vocab.tokens[vocab.sep_id]
    # One text: llama.cpp's WordPiece always ends with the separator. A pair: the worker's
    # composition (`_pair_middle`), ending in EOS (the separator when the vocabulary has none).
    middle = _pair_middle(vocab)
    eos = vocab.eos_id if vocab.eos_id is not None else vocab.sep_id
    tail = [(vocab.tokens[eos], eos)] if vocab.add_eos else []
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls_text} $A {sep_text}",
        pair=" ".join(
            [cls_text, "$A", *(t for t, _ in middle), "$B:1", *(f"{t}:1" for t, _ in tail)]
        ),
        special_tokens=list(
            dict([(cls_text, vocab.bos_id), (sep_text, vocab.sep_id), *middle, *tail]).items()
        ),
    )
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


# A control piece's text in the Unigram model, made unreachable: llama.cpp's Viterbi never
# matches control or unknown tokens against text (they are not in its token trie), HF's would.
# U+0000 never reaches a tokenizer (the host's sanitizer turns it into a space).
_UNREACHABLE = "\x00{}\x00"


def _never_chosen_unused(vocab: GGUFVocab, kinds: list[int]) -> set[int]:
    """UNUSED pieces llama.cpp's Viterbi can never pick: those scoring below spelling their
    text one code point at a time.

    llama.cpp's converter pads an XLM-RoBERTa vocabulary up to the config's `vocab_size` with
    `[PADn]` pieces typed UNUSED at score -10000 (multilingual-e5 checkpoints have such rows).
    llama.cpp keeps them matchable, but its unknown-token score comes from NORMAL pieces only.
    Spelling a piece's span code point by code point costs at most, per code point, its best
    single-code-point piece or (with none) the unknown score; a piece scoring strictly below
    that sum loses to it on every path, so leaving it out of the derived model changes no
    tokenization while keeping HF's unknown score (the lowest of its pieces) llama.cpp's.
    """
    normal = [float(vocab.scores[i]) for i, k in enumerate(kinds) if k == TYPE_NORMAL]
    if not normal:
        return set()
    unknown = min(normal) - _UNKNOWN_PENALTY
    matchable = (TYPE_NORMAL, TYPE_USER_DEFINED, TYPE_UNUSED)
    single: dict[str, float] = {}
    for i, (text, kind) in enumerate(zip(vocab.tokens, kinds, strict=True)):
        if kind in matchable and len(text) == 1:
            score = 0.0 if kind == TYPE_USER_DEFINED else float(vocab.scores[i])
            single[text] = max(score, single.get(text, -np.inf))
    never = set()
    for i, (text, kind) in enumerate(zip(vocab.tokens, kinds, strict=True)):
        if kind != TYPE_UNUSED or float(vocab.scores[i]) >= min(normal) or len(text) < 2:
            continue
        # The same normalizer runs on text and pieces alike; a code point absent from the
        # single pieces falls back to the unknown score, as in llama.cpp.
        spelled = sum(single.get(c, unknown) for c in text)
        if float(vocab.scores[i]) < spelled:
            never.add(i)
    return never


# llama.cpp's `unknown_token_score_penalty` (and SentencePiece's / HF's kUnkPenalty).
_UNKNOWN_PENALTY = 10.0


def _build_ugm(vocab: GGUFVocab) -> Tokenizer:
    """llama.cpp's Unigram (llm_tokenizer_ugm): SentencePiece's precompiled normalizer, its
    whitespace handling, then one Viterbi over each fragment with the pieces' log
    probabilities (unknown code points: min normal score - 10, runs merged into one unknown);
    BOS/EOS as the vocabulary says (llama.cpp's defaults for t5: EOS only)."""
    if vocab.unk_id is None:
        raise UnsupportedVocab("a Unigram vocabulary needs an unknown token id")
    kinds = effective_types(vocab)
    never = _never_chosen_unused(vocab, kinds)
    pieces = []
    for i, (text, kind) in enumerate(zip(vocab.tokens, kinds, strict=True)):
        if kind in (TYPE_CONTROL, TYPE_UNKNOWN, TYPE_BYTE) or i in never:
            pieces.append((_UNREACHABLE.format(i), 0.0))
        else:
            pieces.append((text, 0.0 if kind == TYPE_USER_DEFINED else float(vocab.scores[i])))
    # llama.cpp's unknown score is the lowest NORMAL score minus 10; HF's Unigram takes the
    # lowest score of every piece it holds, so no piece left in the model may score below.
    normal = [float(vocab.scores[i]) for i, k in enumerate(kinds) if k == TYPE_NORMAL]
    if normal and min(normal) > min(score for _, score in pieces):
        raise UnsupportedVocab(
            "a non-normal piece scores below every normal one and could still be chosen: "
            "the unknown penalty would differ from llama.cpp's"
        )
    tok = Tokenizer(models.Unigram(pieces, unk_id=vocab.unk_id, byte_fallback=False))
    steps: list[normalizers.Normalizer] = []
    if vocab.charsmap:
        steps.append(normalizers.Precompiled(vocab.charsmap))
    if vocab.remove_extra_whitespaces:  # one space per run, none at the ends
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex("^ | $"), "")]
    if vocab.add_space_prefix or vocab.remove_extra_whitespaces:
        # llama.cpp prepends the space where the first non-space character starts, so a
        # fragment of spaces only gets none: a space at the start iff one follows.
        steps.append(normalizers.Replace(Regex("^(?= *[^ ])"), " "))
    steps.append(normalizers.Replace(" ", SPACE_ESCAPE))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = None  # one Viterbi over the whole fragment, as llama.cpp runs it
    # Control pieces are unreachable in the model and get their ids from the template only.
    _add_vocabulary_tokens(tok, vocab.tokens, kinds, control=False)
    prefix = (
        [(vocab.tokens[vocab.bos_id], vocab.bos_id)]
        if (vocab.add_bos and vocab.bos_id is not None)
        else []
    )
    suffix = (
        [(vocab.tokens[vocab.eos_id], vocab.eos_id)]
        if (vocab.add_eos and vocab.eos_id is not None)
        else []
    )
    head, tail = [t for t, _ in prefix], [t for t, _ in suffix]
    middle = _pair_middle(vocab)
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join([*head, "$A", *tail]),
        pair=" ".join([*head, "$A", *(t for t, _ in middle), "$B:1", *(f"{t}:1" for t in tail)]),
        special_tokens=list(dict(prefix + suffix + middle).items()),
    )
    tok.decoder = decoders.Metaspace(replacement=SPACE_ESCAPE, prepend_scheme="always")
    return tok


# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp, written for its own splitter), by the
# kind llama.cpp maps a `tokenizer.ggml.pre` name to.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?"
    r"\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GRANITE_EMB_MULTI_REGEX = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?"
    r"((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Every byte-level `tokenizer.ggml.pre` the pinned llama.cpp converter writes for a family
# served here (its `get_vocab_base_pre` table names one per checkpoint tokenizer it knows), and
# the regex llama.cpp splits with for it. WordPiece (BERT, NomicBERT), Unigram (XLM-RoBERTa)
# and SentencePiece (Gemma 3) vocabularies carry no byte-level pre-tokenizer.
BPE_PRE_TOKENIZERS = {
    "qwen2": _QWEN2_REGEX,  # Qwen3-Embedding (and Qwen2 / gte-Qwen2)
    "f2llmv2": _QWEN2_REGEX,  # F2LLM-v2: Qwen3 embedders
    "modern-bert": _GPT2_REGEX,  # ModernBERT (answerdotai/ModernBERT-*): GPT-2's split
    "granite-embed-multi-97m": _GRANITE_EMB_MULTI_REGEX,  # granite-embedding R2 (ModernBERT)
}


def _build_bpe(vocab: GGUFVocab) -> Tokenizer:
    """llama.cpp's byte-level BPE: split by the pre-tokenizer's regex, map bytes to GPT-2's
    printable alphabet, merge by the merges' rank; BOS/EOS as the vocabulary says."""
    if not vocab.merges:
        raise UnsupportedVocab("a byte-level BPE vocabulary without merges")
    merges = []
    for m in vocab.merges:
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise UnsupportedVocab(f"unreadable merge {m!r}")
        merges.append((left, right))
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(vocab.tokens)},
            merges=merges,
            ignore_merges=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(BPE_PRE_TOKENIZERS[vocab.pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    _add_vocabulary_tokens(tok, vocab.tokens, effective_types(vocab))
    tok.post_processor = _template(vocab)
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_vocabulary_tokens(
    tok: Tokenizer, tokens: list[str], kinds: list[int], control: bool = True
) -> None:
    """llama.cpp's special-token partition as HF added tokens (unnormalized): user-defined
    tokens always split out as text, control/unknown ones as special tokens (which the host's
    `encode_special_tokens` leaves as text, llama.cpp's `special=False`). Ids are kept because
    every added token already is a piece of the model's vocabulary."""
    if control:
        tok.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, k in zip(tokens, kinds, strict=True)
                if k in (TYPE_CONTROL, TYPE_UNKNOWN)
            ]
        )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, kinds, strict=True)
            if k == TYPE_USER_DEFINED
        ]
    )


def _pair_middle(vocab: GGUFVocab) -> list[tuple[str, int]]:
    """The tokens between the two texts of a pair, as the llama.cpp worker composes a rerank
    pair (llama-server's rule): `[BOS] a [EOS] [SEP] b [EOS]`, each as the vocabulary's add
    flags say, EOS falling back to SEP. The host counts and cuts pairs by this template."""
    eos = vocab.eos_id if vocab.eos_id is not None else vocab.sep_id
    middle = []
    if vocab.add_eos and eos is not None:
        middle.append((vocab.tokens[eos], eos))
    if vocab.add_sep and vocab.sep_id is not None:
        middle.append((vocab.tokens[vocab.sep_id], vocab.sep_id))
    return middle


def _template(vocab: GGUFVocab) -> processors.TemplateProcessing:
    prefix: list[str] = []
    suffix: list[str] = []
    specials: list[tuple[str, int]] = []
    if vocab.add_bos and vocab.bos_id is not None:
        prefix.append(vocab.tokens[vocab.bos_id])
        specials.append((vocab.tokens[vocab.bos_id], vocab.bos_id))
    # Every token the template names must be declared once, even when EOS is BOS's id but BOS
    # is not added (Qwen3: both are <|endoftext|>, only the EOS is appended).
    if vocab.add_eos and vocab.eos_id is not None:
        suffix.append(vocab.tokens[vocab.eos_id])
        if not specials or vocab.eos_id != vocab.bos_id:
            specials.append((vocab.tokens[vocab.eos_id], vocab.eos_id))
    single = " ".join([*prefix, "$A", *suffix])
    middle = _pair_middle(vocab)
    pair = " ".join([*prefix, "$A", *(t for t, _ in middle), "$B:1", *(f"{t}:1" for t in suffix)])
    specials += [(t, i) for t, i in middle if t not in {s for s, _ in specials}]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _decoder(vocab: GGUFVocab) -> decoders.Decoder:
    steps: list[decoders.Decoder] = [
        decoders.Replace(SPACE_ESCAPE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # drop the prefix space llama.cpp added
    return decoders.Sequence(steps)


def write_tokenizer_json(gguf_path: str | Path, out_path: str | Path) -> Path:
    """Derive the tokenizer from `gguf_path` and save it as `out_path` (a tokenizer.json).

    Matches `ingest.store.TokenizerBuilder`. Written to a temp name then renamed, so
    a crash never leaves a half-written tokenizer.json behind.
    """
    tok = build_tokenizer(GGUFVocab.read(gguf_path))
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tok.save(str(tmp))
    tmp.replace(out)
    return out
