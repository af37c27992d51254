"""LLM rerankers (a causal decoder that answers "yes" or "no"): what makes a checkpoint one,
and the facts the host needs to compose its pairs (`LlmRerankSpec`, kept in the manifest).

sentence-transformers 6 loads a `...ForCausalLM` directory as a `CrossEncoder` of
`Transformer(text-generation)` + `LogitScore(true_token_id, false_token_id)`: each (query,
document) pair is rendered through the checkpoint's own chat template as the messages
`[system: instruction]? query: q, document: d`, and the raw score is
`logit[true] - logit[false]` at the last position. An `LlmRerankSpec` carries that template, the two
tokens (by string and id), the special-token strings the template may read (transformers
passes its `special_tokens_map` to the render) and the message format sentence-transformers
infers from the template.

A directory is a reranker when its sentence-transformers files say so (modules ending in
`LogitScore`) or, as llama.cpp's converter decides (`Qwen3Model._is_qwen3_reranker` in the
llama.cpp llama-cpp-python 0.3.36 vendors), its README heading or its name says
Qwen3-Reranker. Its template must carry a (query, document) pair as sentence-transformers
probes it (`ingest.chat_template`), or sentence-transformers would not score it either. A GGUF
is one when llama.cpp's converter made it of such a directory: rank
pooling on a decoder, two classifier labels, `cls.output.weight` (the two LM-head rows) and
the checkpoint's Jinja template kept as `tokenizer.chat_template`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import msgspec

from common.errors import ArtifactInvalid, InvalidRequest
from formats.gguf_header import GGUFHeader
from formats.hf_config import HfConfig
from ingest.chat_template import check_pair_roles

MessageFormat = Literal["flat", "structured"]
# The tokens sentence-transformers' CrossEncoder scores with when the checkpoint names none.
DEFAULT_TRUE, DEFAULT_FALSE = "yes", "no"
# The decoder families whose graphs we convert and serve (model_type -> GGUF architecture):
# a reranker of another family is refused by name.
LLM_RERANK_FAMILIES = {"qwen3": "qwen3", "gemma3_text": "gemma3"}
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names its `special_tokens_map` gives a template.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Where a GGUF keeps each of them (gguf-py's Keys.Tokenizer; "seperator" is its spelling).
_GGUF_SPECIAL_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "sep_token": "seperator_token_id",
    "pad_token": "padding_token_id",
    "cls_token": "cls_token_id",
    "mask_token": "mask_token_id",
}
# sentence-transformers' `_infer_format`: a template that reads any of these wants each
# message's content as a list of typed parts; any other template gets plain strings.
_STRUCTURED_PATTERNS = ("content[0]", ".type", "'type'", '"type"', "item.type", "message.content[")


class LlmRerankSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    chat_template: str
    message_format: MessageFormat
    # The two scored tokens of an LLM reranker. None for a one-label decoder sequence
    # classifier whose pairs are rendered through its chat template (`pair_template`): its
    # own score row is the head.
    true_token: str | None = None
    false_token: str | None = None
    true_id: int | None = None
    false_id: int | None = None
    special_tokens: dict[str, str] = {}
    # The instruction a request that names none gets (the checkpoint's default prompt); None:
    # no system message, so the template's own default applies.
    default_instruction: str | None = None
    # Named instructions (sentence-transformers' `prompts` of a CrossEncoder).
    instructions: dict[str, str] = {}


def message_format(template: str) -> MessageFormat:
    return "structured" if any(p in template for p in _STRUCTURED_PATTERNS) else "flat"


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactInvalid(f"unreadable {path}: {e}") from e


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # an AddedToken serialised as an object
        value = value.get("content")
    return value if isinstance(value, str) else None


def st_logit_score(model_dir: Path) -> dict | None:
    """The LogitScore module's config when the directory's modules end in one, else None."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return None
    modules = _read_json(modules_path)
    if not isinstance(modules, list) or not modules or not isinstance(modules[-1], dict):
        return None
    last = modules[-1]
    if not str(last.get("type", "")).endswith("LogitScore"):
        return None
    cfg_path = model_dir / str(last.get("path", "")) / "config.json"
    cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
    if not isinstance(cfg, dict):
        raise ArtifactInvalid(f"{cfg_path}: expected a JSON object")
    return cfg


def _named_qwen3_reranker(model_dir: Path, config: HfConfig) -> bool:
    """llama.cpp's converter's rule: a README heading, or a name, saying Qwen3-Reranker."""
    readme = model_dir / "README.md"
    text = readme.read_text(encoding="utf-8", errors="replace").lower() if readme.is_file() else ""
    if "# qwen3-reranker" in text or "# qwen3-vl-reranker" in text:
        return True
    name_or_path = config.get("_name_or_path", "")
    hints = [model_dir.name, str(name_or_path) if isinstance(name_or_path, str) else ""]
    return any("qwen3-reranker" in h.lower() or "qwen3-vl-reranker" in h.lower() for h in hints)


def is_llm_reranker(model_dir: Path, config: HfConfig) -> bool:
    """Whether a `...ForCausalLM` directory is served as a reranker (see the module doc)."""
    archs = config.architectures or []
    if len(archs) != 1 or not archs[0].endswith("ForCausalLM"):
        return False
    if st_logit_score(model_dir) is not None:
        return True
    return config.model_type == "qwen3" and _named_qwen3_reranker(model_dir, config)


def _hf_template(model_dir: Path, tok_cfg: dict) -> str:
    """The template transformers' tokenizer loads: `chat_template.jinja`, else
    tokenizer_config.json's `chat_template` (a string, or named ones: the "default")."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    raw = tok_cfg.get("chat_template")
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default")
    if not isinstance(raw, str) or not raw.strip():
        raise ArtifactInvalid(
            f"{model_dir} has no chat template (chat_template.jinja or tokenizer_config.json): "
            "an LLM reranker's pairs are rendered through it"
        )
    return raw


def _vocab_ids(tokenizer_json: dict) -> dict[str, int]:
    model = tokenizer_json.get("model") or {}
    vocab = dict(model.get("vocab") or {}) if isinstance(model.get("vocab"), dict) else {}
    for added in tokenizer_json.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("content"), str):
            vocab[added["content"]] = int(added["id"])
    return vocab


def _pick_tokens(
    ids: dict[str, int],
    true_token: str | None,
    false_token: str | None,
    logit_score: dict | None,
) -> tuple[str, str, int, int]:
    """The two scored tokens: the user's (`--true-token/--false-token`), else the ids the
    LogitScore module names, else "yes"/"no" as sentence-transformers picks them. Each must be
    one token of the vocabulary (sentence-transformers looks them up as tokens, not text)."""
    by_id = {v: k for k, v in ids.items()}
    if true_token is None and false_token is None and logit_score is not None:
        t, f = logit_score.get("true_token_id"), logit_score.get("false_token_id")
        if f is None:
            raise ArtifactInvalid(
                "the LogitScore module scores one token's logit (no false_token_id); only "
                "logit[true] - logit[false] rerankers are served"
            )
        if not isinstance(t, int) or not isinstance(f, int) or t not in by_id or f not in by_id:
            raise ArtifactInvalid(f"LogitScore token ids {t!r}/{f!r} are not in the vocabulary")
        return by_id[t], by_id[f], t, f
    true_token = DEFAULT_TRUE if true_token is None else true_token
    false_token = DEFAULT_FALSE if false_token is None else false_token
    missing = [tok for tok in (true_token, false_token) if tok not in ids]
    if missing:
        raise InvalidRequest(
            f"the tokenizer has no single token {missing[0]!r}: an LLM reranker scores "
            "logit[true] - logit[false] of two tokens; name them with --true-token/--false-token"
        )
    if true_token == false_token:
        raise InvalidRequest("the true and false tokens must differ")
    return true_token, false_token, ids[true_token], ids[false_token]


def _tokenizer_files(model_dir: Path) -> tuple[dict, dict]:
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise ArtifactInvalid(f"{model_dir} has no tokenizer.json")
    tok_json = _read_json(tok_path)
    cfg_path = model_dir / "tokenizer_config.json"
    tok_cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
    if not isinstance(tok_json, dict) or not isinstance(tok_cfg, dict):
        raise ArtifactInvalid(f"{model_dir}: tokenizer files are not JSON objects")
    return tok_json, tok_cfg


def spec_from_hf_dir(
    model_dir: Path,
    *,
    true_token: str | None = None,
    false_token: str | None = None,
    instructions: dict[str, str] | None = None,
    default_instruction_name: str | None = None,
) -> LlmRerankSpec:
    tok_json, tok_cfg = _tokenizer_files(model_dir)
    template = _hf_template(model_dir, tok_cfg)
    t, f, tid, fid = _pick_tokens(
        _vocab_ids(tok_json), true_token, false_token, st_logit_score(model_dir)
    )
    return _with_template(
        model_dir, tok_cfg, template, instructions, default_instruction_name, (t, f, tid, fid)
    )


def pair_template(
    model_dir: Path,
    *,
    instructions: dict[str, str] | None = None,
    default_instruction_name: str | None = None,
) -> LlmRerankSpec | None:
    """How sentence-transformers' CrossEncoder composes a one-label decoder sequence
    classifier's pairs: through the tokenizer's chat template when it has one (CrossEncoder
    turns every pair into query/document messages then, whatever the head), as a plain
    tokenizer pair otherwise (None)."""
    _, tok_cfg = _tokenizer_files(model_dir)
    try:
        template = _hf_template(model_dir, tok_cfg)
    except ArtifactInvalid:
        return None
    return _with_template(model_dir, tok_cfg, template, instructions, default_instruction_name)


def _with_template(
    model_dir: Path,
    tok_cfg: dict,
    template: str,
    instructions: dict[str, str] | None,
    default_instruction_name: str | None,
    tokens: tuple[str, str, int, int] | None = None,
) -> LlmRerankSpec:
    t: str | None = None
    f: str | None = None
    tid: int | None = None
    fid: int | None = None
    if tokens is not None:
        t, f, tid, fid = tokens
    specials = {}
    smap_path = model_dir / "special_tokens_map.json"
    smap = _read_json(smap_path) if smap_path.is_file() else {}
    for key in SPECIAL_TOKEN_NAMES:
        value = _token_text(tok_cfg.get(key)) or (
            _token_text(smap.get(key)) if isinstance(smap, dict) else None
        )
        if value is not None:
            specials[key] = value
    named = dict(instructions or {})
    default = named.get(default_instruction_name) if default_instruction_name else None
    check_pair_roles(template, message_format(template), specials)
    return LlmRerankSpec(
        chat_template=template,
        true_token=t,
        false_token=f,
        true_id=tid,
        false_id=fid,
        message_format=message_format(template),
        special_tokens=specials,
        default_instruction=default,
        instructions=named,
    )


def spec_from_gguf(hdr: GGUFHeader, tokens: list[str]) -> LlmRerankSpec:
    """From a GGUF llama.cpp's converter made of an LLM reranker: the Jinja template it keeps
    as `tokenizer.chat_template` (not `tokenizer.chat_template.rerank`, a rendered prompt
    with the default instruction hard-wired), the two labels of `classifier.output_labels`
    (true first, as the converter orders `cls.output.weight`'s rows). `hdr` must have been
    read with the labels array; `tokens` is the vocabulary."""
    template = hdr.kv.get("tokenizer.chat_template")
    if not isinstance(template, str) or not template.strip():
        raise ArtifactInvalid(
            f"{hdr.architecture} reranker GGUF has no tokenizer.chat_template: its pairs cannot "
            "be rendered as the checkpoint's template renders them (tokenizer.chat_template."
            "rerank hard-wires the default instruction); convert it again from a directory "
            "whose tokenizer_config.json has its chat template"
        )
    labels = hdr.arch_get("classifier.output_labels")
    if (
        not isinstance(labels, list)
        or len(labels) != 2
        or not all(isinstance(s, str) for s in labels)
    ):
        raise ArtifactInvalid(
            f"an LLM reranker GGUF names its two scored tokens in {hdr.architecture}."
            f"classifier.output_labels; this one has {labels!r}"
        )
    ids = {tok: i for i, tok in reversed(list(enumerate(tokens)))}
    t, f, tid, fid = _pick_tokens(ids, labels[0], labels[1], None)
    specials = {}
    for key, gguf_key in _GGUF_SPECIAL_KEYS.items():
        value = hdr.kv.get(f"tokenizer.ggml.{gguf_key}")
        if isinstance(value, int) and 0 <= value < len(tokens):
            specials[key] = tokens[value]
    check_pair_roles(template, message_format(template), specials)
    return LlmRerankSpec(
        chat_template=template,
        true_token=t,
        false_token=f,
        true_id=tid,
        false_id=fid,
        message_format=message_format(template),
        special_tokens=specials,
    )
