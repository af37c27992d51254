"""workers.llama.model_kind: what a GGUF is served as, from its header and the config alone
(headers built in memory; the engine tests load the real files)."""

from __future__ import annotations

import llama_cpp
import pytest

from formats.gguf_header import ArrayInfo, GGUFHeader, TensorInfo
from workers.engine import EngineError
from workers.llama.config import RuntimeConfig
from workers.llama.model_kind import (
    POOLING_TYPES,
    decide_kind,
    default_ref,
    is_causal,
    n_cls_out,
)


def _hdr(arch: str, tensors: tuple[str, ...] = (), **kv: object) -> GGUFHeader:
    keys = {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in kv.items()}}
    return GGUFHeader(
        version=3, kv=keys, tensors=[TensorInfo(name, (1,), 0, 0, 4) for name in tensors]
    )


def _refused(hdr: GGUFHeader, cfg: RuntimeConfig, code: str) -> str:
    with pytest.raises(EngineError) as e:
        decide_kind(hdr, cfg)
    assert e.value.code == code
    return e.value.msg


def test_pooling_types_are_llama_cpp_s() -> None:
    assert POOLING_TYPES == {
        "none": llama_cpp.LLAMA_POOLING_TYPE_NONE,
        "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
        "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
        "rank": llama_cpp.LLAMA_POOLING_TYPE_RANK,
    }


def test_causality() -> None:
    assert is_causal(_hdr("llama"))  # llama.cpp's default when the key is absent
    assert not is_causal(_hdr("bert", **{"attention.causal": False}))
    # EmbeddingGemma is bidirectional whatever the file says.
    assert not is_causal(_hdr("gemma-embedding", **{"attention.causal": True}))


def test_default_ref_and_classifier_width() -> None:
    assert default_ref("/store/minilm/model.gguf") == "minilm"
    assert default_ref("/x/gemma-270m.gguf") == "gemma-270m"
    assert default_ref("model.gguf") == "model"
    assert n_cls_out(_hdr("bert")) == 1
    assert n_cls_out(_hdr("bert", **{"classifier.output_labels": ArrayInfo(8, 3)})) == 3


def test_kind_from_the_file() -> None:
    bert = _hdr("bert", **{"attention.causal": False, "pooling_type": 1})
    assert decide_kind(bert, RuntimeConfig()) == ("embed", "mean")
    assert decide_kind(bert, RuntimeConfig(pooling="cls")) == ("embed", "cls")
    assert decide_kind(_hdr("bert", **{"attention.causal": False}), RuntimeConfig()) == (
        "embed",
        "mean",
    )
    assert decide_kind(_hdr("gemma3"), RuntimeConfig()) == ("generate", "none")
    assert decide_kind(_hdr("gemma3"), RuntimeConfig(embedding=True)) == ("embed", "last")
    ranker = _hdr("bert", **{"attention.causal": False, "pooling_type": 4})
    assert decide_kind(ranker, RuntimeConfig()) == ("rerank", "rank")
    # llama.cpp's converter writes no pooling type for a reranker: its head makes it one.
    headed = _hdr("bert", ("cls.weight",), **{"attention.causal": False})
    assert decide_kind(headed, RuntimeConfig(kind="rerank")) == ("rerank", "rank")
    assert decide_kind(headed, RuntimeConfig()) == ("embed", "mean")


def test_kind_refusals() -> None:
    qwen = _hdr("qwen3", **{"pooling_type": 4})
    assert "two-row head" in _refused(qwen, RuntimeConfig(), "unsupported")
    llm = _hdr("qwen3", **{"pooling_type": 4, "embedding_length": 8})
    llm.tensors = [TensorInfo("cls.output.weight", (8, 2), 0, 0, 64)]
    # An LLM reranker: the host renders its pairs, the worker reads its last token's state.
    assert decide_kind(llm, RuntimeConfig()) == ("rerank", "last")
    assert decide_kind(llm, RuntimeConfig(kind="rerank", pooling="rank")) == ("rerank", "last")
    assert "cannot be served as embed" in _refused(
        llm, RuntimeConfig(kind="embed"), "config_invalid"
    )
    templ = _hdr("bert", **{"pooling_type": 4})
    templ.kv["tokenizer.chat_template.rerank"] = "{query}{document}"
    assert "prompt template" in _refused(templ, RuntimeConfig(), "unsupported")
    bert = _hdr("bert", **{"attention.causal": False, "pooling_type": 1})
    assert "contradicts" in _refused(
        bert, RuntimeConfig(kind="embed", embedding=False), "config_invalid"
    )
    assert "rank pooling" in _refused(bert, RuntimeConfig(kind="rerank"), "config_invalid")
    assert "cannot generate" in _refused(bert, RuntimeConfig(kind="generate"), "config_invalid")
    assert "one vector" in _refused(bert, RuntimeConfig(pooling="none"), "config_invalid")
    gen = _hdr("gemma3")
    assert "embedding models only" in _refused(
        gen, RuntimeConfig(kind="generate", pooling="mean"), "config_invalid"
    )
    ranker = _hdr("bert", **{"attention.causal": False, "pooling_type": 4})
    assert "must use rank" in _refused(
        ranker, RuntimeConfig(kind="rerank", pooling="mean"), "config_invalid"
    )


def test_heads_on_a_decoders_last_token() -> None:
    """A Qwen3 GGUF marked as a sequence classifier is scored by its N rows at the last token
    (llama.cpp's RANK pooling would softmax them); a Gemma 3 reranker, whose graph loads no
    cls.output, by its two labels' rows of the LM head."""
    from formats.gguf_header import SEQ_CLS_PAD_KEY

    labels = {"classifier.output_labels": ArrayInfo(8, 3), "embedding_length": 8}
    cls = _hdr("qwen3", **{"pooling_type": 4, **labels})
    cls.kv[SEQ_CLS_PAD_KEY] = 5
    assert "its head cls.output.weight (3 rows" in _refused(cls, RuntimeConfig(), "unsupported")
    cls.tensors = [TensorInfo("cls.output.weight", (8, 3), 0, 0, 96)]
    assert decide_kind(cls, RuntimeConfig(kind="rerank", pooling="last")) == ("rerank", "last")
    assert "scores the last token" in _refused(cls, RuntimeConfig(pooling="mean"), "config_invalid")
    gemma = _hdr(
        "gemma3",
        ("token_embd.weight",),
        **{"pooling_type": 4, "embedding_length": 1, "classifier.output_labels": ArrayInfo(8, 2)},
    )
    assert decide_kind(gemma, RuntimeConfig()) == ("rerank", "last")
    gemma.kv["gemma3.classifier.output_labels"] = ArrayInfo(8, 3)
    assert "two labels the LM head holds" in _refused(gemma, RuntimeConfig(), "unsupported")


def test_a_classifier_head_reads_the_rightmost_non_pad_token() -> None:
    """transformers' `(arange * (ids != pad)).argmax()`: trailing pads are skipped, inner ones
    kept, and a sequence of pads alone is read at its first token."""
    import numpy as np

    from workers.llama.llm_head import DecoderHead

    head = DecoderHead("classifier", np.eye(2), pad_id=0)
    assert head.strip_pads(np.array([5, 0, 6, 0, 0])).tolist() == [5, 0, 6]
    assert head.strip_pads(np.array([0, 0])).tolist() == [0]
    assert DecoderHead("classifier", np.eye(2)).strip_pads(np.array([5, 0])).tolist() == [5, 0]
    assert head.apply(np.array([[1.0, 2.0]])).tolist() == [[1.0, 2.0]]
