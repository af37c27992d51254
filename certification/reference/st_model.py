"""The fp32 reference of any model family: sentence-transformers / transformers on the CPU.

Imported only when sentence-transformers is installed and chosen (`certification.oracle`
picks it): this module imports torch at the top, and a machine without torch still certifies
BERT models with the numpy reference.

What is compared is the forward alone. Certification tokenizes module-side, so this reference
never tokenizes: it is given the very ids the lane got and builds the features dict from them
(input_ids, attention_mask, and token_type_ids when the model's forward takes them), then runs
the model's own module pipeline on it. Pooling, Dense projections and Normalize are whatever
the directory's modules.json declares, so the lane is judged against the model as published,
not against our reading of it. A plain Hugging Face directory has no pooling of its own; it is
pooled the way the lane pools (the artifact's manifest), which is the only pooling it has.

Embedders load as `SentenceTransformer(dir, device="cpu")`, rerankers (sequence-
classification models) as `CrossEncoder(dir, device="cpu")` with the identity activation:
the lane returns raw logits, so the reference must too. Every parameter is float32 whatever
dtype the checkpoint was saved in. Sequences are padded on the right (their positions are
then those of the unpadded sequence, which is what the lane computes) in length-sorted
batches; the attention mask keeps padding out of every real token.

Threads: the runner runs the reference in a thread beside the lane (one core each), so the
forward uses `threads` intra-op threads while it runs and restores the caller's count after.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import sentence_transformers  # noqa: F401  (absent: this module does not import, by design)
import torch

from formats.st_layout import read_layout

# Padded tokens per forward call and rows per call: bounded memory, efficient GEMMs.
_MAX_BATCH_TOKENS = 8192
_MAX_BATCH_ROWS = 64
# The lane's pooling names (the manifest's) in sentence-transformers' spelling.
_ST_POOLING = {"mean": "mean", "cls": "cls", "last": "lasttoken"}


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def versions() -> dict[str, str]:
    """The packages whose code computes this reference, without importing any more of them."""
    return {name: _version(name) for name in ("sentence-transformers", "transformers", "torch")}


def describe() -> str:
    """What a certificate records as its judge, e.g. "sentence-transformers 6.2.0
    (transformers 5.24.0, torch 2.13.0, fp32 CPU)"."""
    v = versions()
    torch_v = v["torch"].split("+", 1)[0]  # "+cpu" is said by "CPU"
    return (
        f"sentence-transformers {v['sentence-transformers']} (transformers "
        f"{v['transformers']}, torch {torch_v}, fp32 CPU)"
    )


def cache_tag() -> str:
    """The exact versions (local build tags included): results computed by other code are
    never reused."""
    return "st;" + ";".join(f"{k}={v}" for k, v in sorted(versions().items())) + ";fp32-cpu"


class STReference:
    def __init__(self, model_dir: str | Path, pooling: str | None = None, threads: int = 1):
        """`pooling`: the lane's, used only when the directory declares no Pooling module."""
        self.dir = Path(model_dir)
        self.pooling = pooling
        self.threads = threads
        self._lock = threading.Lock()
        self._embedder = None
        self._cross_encoder = None

    # ---- models ---------------------------------------------------------------------------

    def embedder(self):
        with self._lock:
            if self._embedder is None:
                self._embedder = self._load_embedder()
            return self._embedder

    def cross_encoder(self):
        with self._lock:
            if self._cross_encoder is None:
                from sentence_transformers import CrossEncoder

                model = CrossEncoder(
                    str(self.dir),
                    device="cpu",
                    local_files_only=True,
                    model_kwargs={"dtype": torch.float32},
                    activation_fn=torch.nn.Identity(),
                )
                self._cross_encoder = _fp32(model)
            return self._cross_encoder

    def llm_scores(
        self, pairs: Sequence[tuple[str, str]], instruction: str | None, max_length: int
    ) -> np.ndarray:
        """An LLM reranker's raw scores (`LogitScore`: logit[true] - logit[false]) of the
        texts themselves: sentence-transformers renders the pairs through the checkpoint's
        chat template, independently of the host's rendering under test. `max_length`: its
        own cut, set past every pair given (they come cut as the lane cut them)."""
        model = self.cross_encoder()
        kw = {} if instruction is None else {"prompt": instruction}
        with self._lock, torch.inference_mode():
            torch.set_num_threads(self.threads)
            model.max_seq_length = max_length
            out = model.predict(list(pairs), batch_size=16, **kw)
        return np.asarray(out, dtype=np.float64)

    def _load_embedder(self):
        from sentence_transformers import SentenceTransformer

        kw = {"device": "cpu", "local_files_only": True, "model_kwargs": {"dtype": torch.float32}}
        if read_layout(self.dir).pooling_modes:
            return _fp32(SentenceTransformer(str(self.dir), **kw))
        # No Pooling module (a plain HF directory): the lane's pooling, then L2 (as the lane
        # is asked to normalize). Built from modules, so sentence-transformers does not guess.
        from sentence_transformers.base.modules import Normalize, Transformer
        from sentence_transformers.sentence_transformer.modules import Pooling

        if self.pooling not in _ST_POOLING:
            raise ValueError(
                f"{self.dir} declares no pooling and the lane's pooling "
                f"{self.pooling!r} is none of {sorted(_ST_POOLING)}"
            )
        transformer = Transformer(
            str(self.dir),
            model_kwargs={**kw["model_kwargs"], "local_files_only": True},
            processor_kwargs={"local_files_only": True},
            config_kwargs={"local_files_only": True},
        )
        pool = Pooling(
            transformer.get_embedding_dimension(), pooling_mode=_ST_POOLING[self.pooling]
        )
        return _fp32(SentenceTransformer(modules=[transformer, pool, Normalize()], device="cpu"))

    # ---- forward --------------------------------------------------------------------------

    def embed(self, ids: Sequence[np.ndarray]) -> np.ndarray:
        """The directory's own sentence embedding of each id sequence, then L2-normalized
        (a no-op when the directory normalizes itself): float32 (n, dims)."""
        model = self.embedder()
        out = self._run(model, ids, None, "sentence_embedding")
        norms = np.linalg.norm(out.astype(np.float64), axis=1, keepdims=True)
        return (out / np.maximum(norms, 1e-12)).astype(np.float32)

    def scores(self, ids: Sequence[np.ndarray], types: Sequence[np.ndarray]) -> np.ndarray:
        """The first logit of each composed pair (what the lane returns): float32 (n,)."""
        out = self._run(self.cross_encoder(), ids, types, "scores")
        return np.ascontiguousarray(out.reshape(len(ids), -1)[:, 0], dtype=np.float32)

    def label_logits(self, ids: Sequence[np.ndarray], types: Sequence[np.ndarray]) -> np.ndarray:
        """Every label's raw logit of each sequence (the CrossEncoder built with no
        activation): float32 (n, n_labels)."""
        out = self._run(self.cross_encoder(), ids, types, "scores")
        return np.ascontiguousarray(out.reshape(len(ids), -1), dtype=np.float32)

    def _run(self, model, ids, types, key: str) -> np.ndarray:
        seqs = [np.asarray(s, dtype=np.int64).reshape(-1) for s in ids]
        if not seqs:
            return np.zeros((0, 0), np.float32)
        if any(len(s) == 0 for s in seqs):
            raise ValueError("an empty id sequence has no embedding")
        hf = _hf_model(model)
        pad = _pad_id(hf)
        typed = "token_type_ids" in inspect.signature(hf.forward).parameters
        left = getattr(model[0], "transformer_task", None) == "text-generation"
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        rows: list[np.ndarray | None] = [None] * len(seqs)
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                for batch in _batches(order, [len(s) for s in seqs]):
                    feats = _features(
                        [seqs[i] for i in batch],
                        [types[i] for i in batch] if types is not None else None,
                        pad,
                        typed,
                        left,
                    )
                    got = model(feats)[key].float().numpy()
                    for j, i in enumerate(batch):
                        rows[i] = got[j]
        finally:
            torch.set_num_threads(before)
        return np.stack(rows).astype(np.float32)  # type: ignore[arg-type]


def _fp32(model):
    model.float()
    model.eval()
    bad = sorted(
        {
            str(p.dtype)
            for p in model.parameters()
            if p.is_floating_point() and p.dtype != torch.float32
        }
    )
    if bad:  # an fp32 reference, or none: a half-precision judge would hide lane error
        raise ValueError(f"reference parameters stayed {bad} after the float32 cast")
    return model


def _hf_model(model):
    """The transformers model inside the first (input) module."""
    first = model[0]
    hf = getattr(first, "model", None) or getattr(first, "auto_model", None)
    if hf is None:
        raise ValueError(f"{type(first).__name__}: not a transformers input module")
    return hf


def _pad_id(hf) -> int:
    # The model's own pad id: position ids of RoBERTa-style models are derived from it.
    pad = getattr(hf.config, "pad_token_id", None)
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    return int(pad) if pad is not None else 0


def _batches(order: list[int], lengths: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    current: list[int] = []
    for i in order:  # longest first: the first row sets the padded width of its batch
        width = lengths[current[0]] if current else lengths[i]
        if current and (
            (len(current) + 1) * width > _MAX_BATCH_TOKENS or len(current) >= _MAX_BATCH_ROWS
        ):
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return out


def _features(
    seqs: list[np.ndarray],
    types: list[np.ndarray] | None,
    pad: int,
    typed: bool,
    left: bool = False,
) -> dict:
    """`left`: padding before the tokens, as sentence-transformers pads a causal LM (its
    LogitScore reads the last position)."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    token_types = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        at = slice(width - len(s), width) if left else slice(0, len(s))
        input_ids[r, at] = torch.from_numpy(s)
        mask[r, at] = 1
        if types is not None:
            t = np.asarray(types[r], dtype=np.int64).reshape(-1)
            if len(t) != len(s):
                raise ValueError("one token type per id")
            token_types[r, at] = torch.from_numpy(t)
    feats = {"input_ids": input_ids, "attention_mask": mask}
    if typed:  # a model without token types has nothing to feed them to (ModernBERT, Qwen3)
        feats["token_type_ids"] = token_types
    return feats


def pipeline_activation(logits: np.ndarray, problem_type: str | None) -> np.ndarray:
    """TextClassificationPipeline.postprocess's default `function_to_apply`, with its own
    numpy functions, per row."""
    from transformers.pipelines.text_classification import sigmoid, softmax

    n_labels = logits.shape[1]
    rows = np.asarray(logits, dtype=np.float32)
    if problem_type == "regression":
        out = rows
    elif problem_type == "multi_label_classification" or n_labels == 1:
        out = np.stack([sigmoid(r) for r in rows]) if len(rows) else rows
    else:
        out = np.stack([softmax(r) for r in rows]) if len(rows) else rows
    return np.asarray(out, dtype=np.float64)
