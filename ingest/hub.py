"""Models by name from the Hugging Face Hub: `synapse models pull ORG/NAME[@REVISION]`.

Every byte comes through `huggingface_hub` (never an HTTP client of ours), into the standard
Hugging Face cache (`HF_HOME` / `HF_HUB_CACHE`): files other tools fetched are reused, ours are
reused by them, a transfer the network cuts resumes where it stopped (huggingface_hub asks
for the rest with a Range request; a pull stopped midway keeps the files it completed and the
next one fetches only the others), and `HF_TOKEN`, `HF_ENDPOINT` and
`HF_HUB_OFFLINE` mean what they mean to every other Hugging Face tool. The cache is the Hub
library's; the store (`ingest.store`) is ours, and nothing is written to it until the files
are complete, so a download that fails (a full disk included) leaves the store as it was.

The rules, in the order a pull applies them:

1. The revision (default `main`) resolves to a commit (one API call, `resolve_revision`,
   which records it in the cache's `refs/`). A model of the store already pulled from that
   repository at that commit is the answer: nothing else is asked, nothing downloaded. With
   `HF_HUB_OFFLINE=1` (or no network) the revision resolves from that record: no request.
2. The repository's listing must hold weights we read: `*.safetensors` (or a sharded index)
   at its top level. Pickled checkpoints (`*.bin`, `*.pt`, `*.pth`, `*.ckpt`) run code when
   loaded and are never fetched; GGUF-only repositories are files to `models ingest`.
3. `config.json` is fetched alone and its `model_type` must be one we convert
   (`ingest.hf_dir.FAMILIES`): an unsupported architecture is refused before any weight.
4. Only the files the model needs are downloaded (`needed_files`): config, tokenizer files,
   the safetensors weights and their index, the sentence-transformers module files
   (`modules.json`, `config_sentence_transformers.json`, `sentence_bert_config.json`,
   `1_Pooling/`, `2_Dense/`...), and `README.md` (model cards name the model's prompts).
   Two `.pt` files are the exception: bge-m3's `colbert_linear.pt` and `sparse_linear.pt`
   heads, which have no safetensors form. They are torch zip archives whose tensors sit in a
   pickle: whoever reads them must do it without unpickling code (a restricted unpickler that
   admits only torch's tensor-rebuild functions, or `torch.load(weights_only=True)`); nothing
   here reads them yet.
5. The snapshot is ingested like `models ingest DIR`; the manifest's provenance records the
   repository, the commit, the endpoint when it is not huggingface.co, and the sha256 of
   every file read (an LFS file whose bytes do not hash to the digest the Hub stored it under
   is refused: `digest_mismatch`).

`models ingest ORG/NAME[@REVISION]` is step 5 on what the cache already holds, without the
network. Every refusal is one typed error: `repo_not_found`, `repo_gated`,
`hub_unreachable`, `storage_full`, `no_supported_weights`, `unsupported_architecture`.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from common.errors import ArtifactInvalid, InvalidRequest, ModelNotFound, StorageFull
from formats.hf_config import HfConfig
from ingest.durable import free_bytes, mib
from ingest.errors import (
    DigestMismatch,
    HubUnreachable,
    NoSupportedWeights,
    RepoGated,
    RepoNotFound,
    UnsupportedModelType,
)
from ingest.hf_common import Dtype
from ingest.hf_dir import FAMILIES
from ingest.provenance import Provenance, file_digests
from ingest.store import ArtifactStore, ModelRecord

DEFAULT_REVISION = "main"
HUB_ENDPOINT = "https://huggingface.co"

# ORG/NAME as the Hub spells repository ids, then an optional @REVISION (branch, tag, commit).
_REF = re.compile(
    r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95})"
    r"(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]{0,127}))?"
)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")

# Files a model needs, as fnmatch patterns over the repository's paths (a `*` crosses `/`).
CONFIG_FILES = ("config.json",)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "sentencepiece.bpe.model",
    "spiece.model",
    "tokenizer.model",
)
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
ST_FILES = (
    "modules.json",
    "config_sentence_transformers.json",
    "sentence_bert_config.json",
    "[0-9]_*/config.json",  # 1_Pooling/config.json, 2_Dense/config.json, 3_Normalize/...
    "[0-9]_*/*.json",
)
CARD_FILES = ("README.md",)
# bge-m3's ColBERT and sparse heads exist only as torch pickles; see the module docstring.
PICKLED_HEADS = ("colbert_linear.pt", "sparse_linear.pt")
NEEDED = CONFIG_FILES + TOKENIZER_FILES + WEIGHT_PATTERNS + ST_FILES + CARD_FILES + PICKLED_HEADS
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class RepoRef:
    repo: str
    revision: str = DEFAULT_REVISION

    def __str__(self) -> str:
        return self.repo if self.revision == DEFAULT_REVISION else f"{self.repo}@{self.revision}"


@dataclass(frozen=True)
class PullResult:
    record: ModelRecord
    # "present": the store had it at that commit; "cached": built from files the cache held;
    # "downloaded": fetched, then built.
    action: Literal["present", "cached", "downloaded"]


def parse_ref(text: str) -> RepoRef | None:
    """`ORG/NAME[@REVISION]` as a repository reference, None when `text` is not one."""
    m = _REF.fullmatch(text)
    if m is None or ".." in text:
        return None
    return RepoRef(m["repo"], m["rev"] or DEFAULT_REVISION)


def require_ref(text: str) -> RepoRef:
    ref = parse_ref(text)
    if ref is None:
        raise InvalidRequest(f"{text!r} is not a Hugging Face repository id (ORG/NAME[@REVISION])")
    return ref


def store_name(repo: str, dtype: Dtype | None = None) -> str:
    """The store name a repository gets by default: its NAME, lowercased (`BAAI/bge-m3` ->
    `bge-m3`), `-f32` added when f32 is asked for, as `models ingest DIR` names a dir."""
    name = re.sub(r"[^a-z0-9._-]+", "-", repo.split("/")[-1].lower()).strip("-.")[:60] or "model"
    return name + "-f32" if dtype == "f32" else name


def needed_files(repo: str, listing: list[str]) -> list[str]:
    """The files of `listing` a model needs; refused when none are weights we read, or when
    there is no `config.json` to say what the model is."""
    if "config.json" not in listing:
        raise UnsupportedModelType(
            f"{repo} has no config.json: not a transformers model we can convert"
        )
    weights = [f for f in listing if "/" not in f and f.endswith(".safetensors")]
    if not weights:
        pickled = sorted(f for f in listing if f.endswith(PICKLE_SUFFIXES))
        ggufs = sorted(f for f in listing if f.endswith(".gguf"))
        if ggufs:
            why = (
                f"it holds GGUF files ({', '.join(ggufs[:3])}): download one and "
                "`synapse models ingest FILE.gguf`"
            )
        elif pickled:
            why = (
                f"only pickled checkpoints ({', '.join(pickled[:3])}), which run code when "
                "loaded and are never fetched"
            )
        else:
            why = "no weight files at all"
        raise NoSupportedWeights(f"{repo} has no safetensors weights at its top level: {why}")
    return sorted(f for f in listing if any(fnmatch.fnmatch(f, p) for p in NEEDED))


def check_config(repo: str, model_dir: Path) -> HfConfig:
    """`config.json`'s model_type is a family we convert."""
    try:
        config = HfConfig.read(model_dir)
    except ArtifactInvalid as e:
        raise UnsupportedModelType(f"{repo}: {e.message}") from None
    if config.model_type not in FAMILIES:
        raise UnsupportedModelType(
            f"{repo} is a {config.model_type!r} model; we convert "
            f"{', '.join(sorted(FAMILIES))} (refused before downloading its weights)"
        )
    return config


# ---- the Hub, through huggingface_hub -------------------------------------------------------


def endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


@contextlib.contextmanager
def hub_errors(ref: RepoRef) -> Iterator[None]:
    """huggingface_hub's exceptions (and the network's, and the disk's) as our typed errors,
    each one line that says what to do."""
    from huggingface_hub import errors as hf

    where = endpoint()
    try:
        yield
    except hf.GatedRepoError:
        token = "the token given has no access to it" if _token() else "no token was given"
        raise RepoGated(
            f"{ref.repo} is gated on {where} and {token}: accept its conditions on its page, "
            "then set HF_TOKEN to a token of that account (or `hf auth login`)"
        ) from None
    except hf.RevisionNotFoundError:
        raise RepoNotFound(f"{ref.repo} has no revision {ref.revision!r} on {where}") from None
    except hf.RepositoryNotFoundError:
        hint = "" if _token() else " (a private one needs HF_TOKEN)"
        raise RepoNotFound(f"no repository {ref.repo} on {where}{hint}") from None
    except hf.OfflineModeIsEnabled:
        raise HubUnreachable(
            f"HF_HUB_OFFLINE is set and the Hugging Face cache ({cache_dir()}) does not hold "
            f"{ref}: unset it, or pull on a machine with network"
        ) from None
    except hf.LocalEntryNotFoundError as e:
        raise HubUnreachable(
            f"cannot reach {where} for {ref}, and the Hugging Face cache ({cache_dir()}) does "
            f"not hold it: {_first_line(e)}"
        ) from None
    except hf.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status == 401:
            raise RepoNotFound(
                f"{where} refused {ref.repo} (401): it is private or the token is invalid"
            ) from None
        raise HubUnreachable(f"{where} answered {status} for {ref}: {_first_line(e)}") from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFull(
                f"the disk of the Hugging Face cache ({cache_dir()}) filled up while "
                f"downloading {ref}: {mib(free_bytes(cache_dir()))} are free; the store is "
                "untouched, the files completed stay in the cache, and the next pull fetches "
                "the rest once there is space"
            ) from None
        if _is_network_error(e):
            raise HubUnreachable(f"cannot reach {where}: {e}") from None
        raise
    except Exception as e:
        if _is_network_error(e):
            raise HubUnreachable(f"cannot reach {where}: {_first_line(e)}") from None
        raise


def _is_network_error(e: BaseException) -> bool:
    """A connection that failed, whichever HTTP library huggingface_hub runs on (httpx's
    TransportError family, requests' ConnectionError), or the socket's own errors."""
    if isinstance(e, ConnectionError | TimeoutError):
        return True
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"TransportError", "ConnectError", "ConnectionError", "Timeout"})


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


@dataclass(frozen=True)
class Listing:
    commit: str
    files: list[str]
    sizes: dict[str, int]
    lfs: dict[str, str]  # file -> sha256 the Hub stores it under (LFS files)


def resolve_commit(ref: RepoRef) -> str:
    """The commit `ref.revision` names: asked of the Hub (one API call), which huggingface_hub
    records in the cache's `refs/`; that record when the Hub cannot be reached or
    `HF_HUB_OFFLINE` is set."""
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf

    try:
        with hub_errors(ref):
            resolved = HfApi().resolve_revision(ref.repo, revision=ref.revision)
    except hf.RevisionResolutionError as e:
        if offline():
            raise HubUnreachable(
                f"HF_HUB_OFFLINE is set and the Hugging Face cache ({cache_dir()}) has no record "
                f"of {ref}: unset it, or pull on a machine with network"
            ) from None
        why = _first_line(e.__cause__ or e)
        raise HubUnreachable(f"cannot reach {endpoint()} for {ref}: {why}") from None
    return str(resolved.resolved)


def listing_at(ref: RepoRef, commit: str) -> Listing:
    """The files of `ref` at `commit`, with their sizes and LFS digests (one API call)."""
    from huggingface_hub import HfApi

    with hub_errors(ref):
        info = HfApi().model_info(ref.repo, revision=commit, files_metadata=True)
    if info.sha != commit:
        raise HubUnreachable(f"{endpoint()} answered commit {info.sha} for {commit}")
    sizes: dict[str, int] = {}
    lfs: dict[str, str] = {}
    for s in info.siblings or []:
        if s.size is not None:
            sizes[s.rfilename] = int(s.size)
        sha = getattr(s.lfs, "sha256", None) if s.lfs is not None else None
        if isinstance(sha, str):
            lfs[s.rfilename] = sha
    return Listing(info.sha, [s.rfilename for s in info.siblings or []], sizes, lfs)


def cached_snapshot(ref: RepoRef, files: list[str] | None = None) -> Path:
    """The cache's snapshot of `ref` (a branch or tag as the cache's refs last resolved it),
    without the network; `HubUnreachable`-free: a miss is `ModelNotFound`."""
    from huggingface_hub import errors as hf
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(
            ref.repo,
            revision=ref.revision,
            # Only what must be there: a cache another tool filled (a sentence-transformers
            # run) may lack a file we would have fetched, and the converter names what it
            # misses.
            allow_patterns=files or list(CONFIG_FILES),
            local_files_only=True,
        )
    except (hf.LocalEntryNotFoundError, FileNotFoundError):
        raise ModelNotFound(
            f"the Hugging Face cache ({cache_dir()}) does not hold {ref}: "
            f"`synapse models pull {ref}` downloads it"
        ) from None
    snapshot = Path(path)
    if files is not None and any(not (snapshot / f).is_file() for f in files):
        raise ModelNotFound(f"the Hugging Face cache holds {ref} only in part")
    return snapshot


def download(ref: RepoRef, listing: Listing, files: list[str]) -> Path:
    """`files` of `ref` at `listing.commit` into the cache (those already there are not
    fetched again; a cut transfer resumes), with huggingface_hub's progress bars."""
    from huggingface_hub import hf_hub_download, snapshot_download

    with hub_errors(ref):
        # config.json alone first: an architecture we do not convert is refused before any
        # weight is downloaded.
        config = hf_hub_download(ref.repo, "config.json", revision=listing.commit)
        check_config(ref.repo, Path(config).parent)
        _check_space(ref, listing, files)
        path = snapshot_download(ref.repo, revision=listing.commit, allow_patterns=files)
    return Path(path)


def _check_space(ref: RepoRef, listing: Listing, files: list[str]) -> None:
    """Refuse a download the cache's disk cannot hold before it starts (the files the cache
    already has count for nothing)."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    blobs = _blob_dir(ref)
    need = sum(
        size
        for f, size in listing.sizes.items()
        if f in files and not (f in listing.lfs and (blobs / listing.lfs[f]).is_file())
    )
    free = free_bytes(root)
    if need > free:
        raise StorageFull(
            f"{ref} needs about {mib(need)} in the Hugging Face cache ({root}), and "
            f"{mib(free)} are free: free some space (or point HF_HUB_CACHE elsewhere) and pull "
            "again"
        )


def _blob_dir(ref: RepoRef) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache_dir() / repo_folder_name(repo_id=ref.repo, repo_type="model") / "blobs"


# ---- into the store -------------------------------------------------------------------------


def snapshot_files(snapshot: Path) -> list[str]:
    """The files of a cache snapshot (relative paths), as they would be pulled."""
    out = []
    for p in snapshot.rglob("*"):
        rel = p.relative_to(snapshot).as_posix()
        if p.is_file() and any(fnmatch.fnmatch(rel, pat) for pat in NEEDED):
            out.append(rel)
    return sorted(out)


def provenance(
    ref: RepoRef, snapshot: Path, commit: str, lfs: dict[str, str] | None = None
) -> Provenance:
    """The manifest's record of a snapshot: every file's sha256, computed from its bytes; an
    LFS file must hash to the digest it is stored under (its blob's name in the cache)."""
    files = snapshot_files(snapshot)
    digests = file_digests(snapshot, files)
    for f, got in digests.items():
        stored = (lfs or {}).get(f) or _blob_sha256(snapshot / f)
        if stored is not None and stored != got:
            raise DigestMismatch(
                f"{ref.repo}/{f} hashes to {got[:12]}, not the {stored[:12]} the Hub stores it "
                "under: the cached file is damaged; remove it from the Hugging Face cache and "
                "pull again"
            )
    where = endpoint()
    return Provenance(
        origin="huggingface",
        repo=ref.repo,
        revision=commit,
        requested=None if ref.revision == commit else ref.revision,
        endpoint=None if where == HUB_ENDPOINT else where,
        files=digests,
    )


def _blob_sha256(path: Path) -> str | None:
    """The sha256 a cached LFS file is stored under: its blob's name (a regular file's blob
    is named by its git sha1, 40 digits, and says nothing of its sha256)."""
    if not path.is_symlink():
        return None
    name = Path(os.readlink(path)).name
    return name if _SHA256.fullmatch(name) else None


def _ingest(
    store: ArtifactStore,
    ref: RepoRef,
    snapshot: Path,
    name: str | None,
    dtype: Dtype | None,
    lfs: dict[str, str] | None = None,
    **options: Any,
) -> ModelRecord:
    commit = snapshot.name
    check_config(ref.repo, snapshot)
    prov = provenance(ref, snapshot, commit, lfs)
    return store.ingest_hf_dir(
        snapshot,
        name=name or store_name(ref.repo, dtype),
        dtype=dtype,
        source=f"hf-dir:{snapshot}",
        provenance=prov,
        **options,
    )


def ingest_cached(
    store: ArtifactStore,
    ref: RepoRef,
    name: str | None = None,
    dtype: Dtype | None = None,
    **options: Any,
) -> PullResult:
    """`models ingest ORG/NAME[@REVISION]`: what the Hugging Face cache holds, no network."""
    snapshot = cached_snapshot(ref)
    present = store.find("huggingface", ref.repo, snapshot.name)
    if present and name is None:
        return PullResult(present[0], "present")
    return PullResult(_ingest(store, ref, snapshot, name, dtype, **options), "cached")


def pull(
    store: ArtifactStore,
    ref: RepoRef,
    name: str | None = None,
    dtype: Dtype | None = None,
    **options: Any,
) -> PullResult:
    """`models pull ORG/NAME[@REVISION]`: resolve, refuse what we cannot serve before the
    download, download what is missing, ingest. See the module docstring for the rules."""
    commit = resolve_commit(ref)
    present = store.find("huggingface", ref.repo, commit)
    if present and name is None:
        return PullResult(present[0], "present")
    if offline():
        # No network at all: what the cache holds at that commit, or a refusal.
        # (the cache's refs, which gave `commit`, name the same snapshot).
        return ingest_cached(store, ref, name, dtype, **options)
    listing = listing_at(ref, commit)
    files = needed_files(ref.repo, listing.files)
    at_commit = RepoRef(ref.repo, listing.commit)
    try:
        snapshot = cached_snapshot(at_commit, files)
        action: Literal["cached", "downloaded"] = "cached"
    except ModelNotFound:
        snapshot = download(ref, listing, files)
        action = "downloaded"
    return PullResult(
        _ingest(store, ref, snapshot, name, dtype, lfs=listing.lfs, **options), action
    )
