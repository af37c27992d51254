"""A Hugging Face Hub on loopback: a real HTTP server speaking the part of the Hub's protocol
`huggingface_hub` uses to resolve a revision and download files, for the real client to pull
from (`HF_ENDPOINT` points it here).

What it answers, as huggingface.co does (read in huggingface_hub's `hf_api.py`,
`file_download.py`, `_snapshot_download.py` and `utils/_http.py`):

- `GET /api/models/{repo}[/revision/{rev}]` (`model_info`, `repo_info`): the commit `sha`
  and the `siblings`, with `size`, `blobId` and `lfs` (`sha256`, `size`, `pointerSize`)
  when `?blobs=true`.
- `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=...` (`list_repo_tree`): one page
  of `{"type": "file", "oid", "size", "path", "lfs": {"oid", "size", "pointerSize"}}`.
- `HEAD|GET /{repo}/resolve/{rev}/{file}`: a regular file answers itself with
  `X-Repo-Commit` and `ETag` (its git blob sha1); an LFS file (`*.safetensors`) answers 302 to
  the CDN, another host (127.0.0.2, so the client does not follow it for metadata), carrying
  `X-Repo-Commit`, `X-Linked-Etag` (its sha256) and `X-Linked-Size`. GETs honour `Range`
  (206), which is how huggingface_hub resumes a transfer the network cut
  (`HubServer.interrupt` cuts one).
- `GET /api/agent-harnesses`: the registry huggingface_hub fetches for itself (at most once
  a day, cached under HF_HOME), empty.
- Errors with the headers huggingface_hub maps to its exceptions: `X-Error-Code:
  RepoNotFound` (404), `RevisionNotFound` (404), `EntryNotFound` (404), `GatedRepo` (401
  without a token, 403 with a wrong one).

Every request is logged (method, path), so a test can say the network was not used.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".pt", ".bin", ".gguf")
CDN_HOST = "127.0.0.2"  # loopback too, but another host to the client


def cut_at(data: bytes) -> int:
    """Where an interrupted transfer of `data` stops."""
    return max(len(data) - (1 << 20), 0)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = ""
    gated_token: str | None = None  # a gated repository opens to this token only
    branches: dict[str, str] = field(default_factory=dict)
    # The listing leaves sizes out (as for files still being uploaded): a client cannot tell
    # the space a download needs before it starts.
    hide_sizes: bool = False

    def __post_init__(self) -> None:
        if not self.commit:
            digest = hashlib.sha1()
            for name in sorted(self.files):
                digest.update(name.encode() + b"\0" + self.files[name])
            self.commit = digest.hexdigest()
        self.branches.setdefault("main", self.commit)


def repo_from_dir(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


class HubServer:
    """`with HubServer({"org/name": Repo(...)}) as hub:` then `hub.endpoint`."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.log: list[tuple[str, str]] = []
        self.ranges: list[tuple[str, str]] = []  # (path, Range header) of ranged GETs
        # sha256s of LFS files whose next whole GET is cut one MiB before its end (the
        # connection closes), as a network drop cuts a download.
        self.interrupt: set[str] = set()
        self._lock = threading.Lock()
        handler = self._handler()
        self._api = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._cdn = ThreadingHTTPServer((CDN_HOST, 0), handler)
        self._threads = [
            threading.Thread(target=s.serve_forever, daemon=True) for s in (self._api, self._cdn)
        ]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._api.server_address[1]}"

    @property
    def cdn(self) -> str:
        return f"http://{CDN_HOST}:{self._cdn.server_address[1]}"

    def __enter__(self) -> HubServer:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for s in (self._api, self._cdn):
            s.shutdown()
            s.server_close()

    def requests(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.log)

    def range_requests(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.ranges)

    def clear(self) -> None:
        with self._lock:
            self.log.clear()
            self.ranges.clear()

    # ---- the protocol -----------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet: the test reads hub.log
                pass

            def do_GET(self) -> None:
                self._route(body=True)

            def do_HEAD(self) -> None:
                self._route(body=False)

            def _route(self, body: bool) -> None:
                with hub._lock:
                    hub.log.append((self.command, self.path))
                    if "Range" in self.headers:
                        hub.ranges.append((self.path, self.headers["Range"]))
                url = urlsplit(self.path)
                path = unquote(url.path)
                query = parse_qs(url.query)
                if path.startswith("/cdn/"):
                    return self._cdn(path.removeprefix("/cdn/"), body)
                if path == "/api/agent-harnesses":  # huggingface_hub's own, cached a day
                    return self._json({"standardEnvVars": [], "harnesses": {}})
                if path.startswith("/api/models/"):
                    return self._api(path.removeprefix("/api/models/"), query)
                parts = path.lstrip("/").split("/")
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo_id, rev, file = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                    return self._resolve(repo_id, rev, file, body)
                self._error(404, "EntryNotFound", "no such route")

            # -- helpers ---------------------------------------------------------------------

            def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _error(self, status: int, code: str, message: str) -> None:
                data = json.dumps({"error": message}).encode()
                self._send(
                    status,
                    data,
                    {
                        "Content-Type": "application/json",
                        "X-Error-Code": code,
                        "X-Error-Message": message,
                    },
                    self.command != "HEAD",
                )

            def _repo(self, repo_id: str) -> Repo | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(404, "RepoNotFound", "Repository not found")
                    return None
                if repo.gated_token is not None:
                    auth = self.headers.get("Authorization", "")
                    if auth != f"Bearer {repo.gated_token}":
                        status = 403 if auth else 401
                        self._error(
                            status,
                            "GatedRepo",
                            f"Access to model {repo_id} is restricted. You must have access "
                            "to it and be authenticated to access it. Please log in.",
                        )
                        return None
                return repo

            def _commit(self, repo: Repo, rev: str) -> str | None:
                commit = repo.branches.get(rev) or (rev if rev == repo.commit else None)
                if commit is None:
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return commit

            def _json(self, payload: object) -> None:
                data = json.dumps(payload).encode()
                self._send(200, data, {"Content-Type": "application/json"}, True)

            def _api(self, rest: str, query: dict[str, list[str]]) -> None:
                parts = rest.split("/")
                repo_id = "/".join(parts[:2])
                repo = self._repo(repo_id)
                if repo is None:
                    return
                tail = parts[2:]
                if not tail or tail[0] == "revision":
                    rev = tail[1] if len(tail) > 1 else "main"
                    commit = self._commit(repo, rev)
                    if commit is None:
                        return
                    blobs = query.get("blobs", ["false"])[0].lower() == "true"
                    self._json(
                        {
                            "id": repo_id,
                            "modelId": repo_id,
                            "sha": commit,
                            "private": False,
                            "gated": "auto" if repo.gated_token else False,
                            "tags": [],
                            "siblings": [
                                self._sibling(f, d, blobs and not repo.hide_sizes)
                                for f, d in repo.files.items()
                            ],
                        }
                    )
                elif tail[0] == "tree" and len(tail) >= 2:
                    commit = self._commit(repo, tail[1])
                    if commit is None:
                        return
                    prefix = "/".join(tail[2:])
                    self._json(
                        [
                            self._tree_entry(f, d)
                            for f, d in sorted(repo.files.items())
                            if not prefix or f.startswith(prefix + "/")
                        ]
                    )
                else:
                    self._error(404, "EntryNotFound", "no such API route")

            def _sibling(self, name: str, data: bytes, blobs: bool) -> dict:
                out: dict = {"rfilename": name}
                if blobs:
                    out["size"] = len(data)
                    out["blobId"] = git_blob_sha1(data)
                    if name.endswith(LFS_SUFFIXES):
                        out["lfs"] = {
                            "sha256": hashlib.sha256(data).hexdigest(),
                            "size": len(data),
                            "pointerSize": 134,
                        }
                return out

            def _tree_entry(self, name: str, data: bytes) -> dict:
                out: dict = {
                    "type": "file",
                    "oid": git_blob_sha1(data),
                    "size": len(data),
                    "path": name,
                }
                if name.endswith(LFS_SUFFIXES):
                    out["lfs"] = {
                        "oid": hashlib.sha256(data).hexdigest(),
                        "size": len(data),
                        "pointerSize": 134,
                    }
                return out

            def _resolve(self, repo_id: str, rev: str, file: str, body: bool) -> None:
                repo = self._repo(repo_id)
                if repo is None:
                    return
                commit = self._commit(repo, rev)
                if commit is None:
                    return
                data = repo.files.get(file)
                if data is None:
                    return self._error(404, "EntryNotFound", f"{file} does not exist")
                if file.endswith(LFS_SUFFIXES):
                    sha = hashlib.sha256(data).hexdigest()
                    headers = {
                        "Location": f"{hub.cdn}/cdn/{repo_id}/{sha}",
                        "X-Repo-Commit": commit,
                        "X-Linked-Etag": f'"{sha}"',
                        "X-Linked-Size": str(len(data)),
                        "ETag": f'"{git_blob_sha1(data)}"',
                    }
                    return self._send(302, b"", headers, body)
                self._ranged(
                    data, {"X-Repo-Commit": commit, "ETag": f'"{git_blob_sha1(data)}"'}, body
                )

            def _cdn(self, rest: str, body: bool) -> None:
                repo_id, _, sha = rest.rpartition("/")
                repo = hub.repos.get(repo_id)
                for data in repo.files.values() if repo else []:
                    if hashlib.sha256(data).hexdigest() != sha:
                        continue
                    with hub._lock:
                        cut = body and "Range" not in self.headers and sha in hub.interrupt
                        hub.interrupt.discard(sha)
                    if cut:
                        self.send_response(200)
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data[: cut_at(data)])
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return None
                    return self._ranged(data, {"ETag": f'"{sha}"'}, body)
                self._send(404, b"", {}, body)

            def _ranged(self, data: bytes, headers: dict[str, str], body: bool) -> None:
                spec = self.headers.get("Range", "")
                if spec.startswith("bytes="):
                    start_s, _, end_s = spec.removeprefix("bytes=").partition("-")
                    start = int(start_s or 0)
                    end = int(end_s) if end_s else len(data) - 1
                    part = data[start : end + 1]
                    headers = {**headers, "Content-Range": f"bytes {start}-{end}/{len(data)}"}
                    return self._send(206, part, headers, body)
                self._send(200, data, headers, body)

        return Handler


# ---- tiny models, built here -----------------------------------------------------------------

# Wide enough that the weights (~12 MB) exceed huggingface_hub's 10 MiB read chunk: a transfer
# cut after the first chunk has bytes on disk to resume from.
TINY_HIDDEN = 96


def tiny_bert_dir(dst: Path, seed: int = 0) -> Path:
    """A sentence-transformers BERT embedder as the Hub lays one out: MiniLM's tokenizer and
    module files around a tiny seeded random BertModel (2 layers, width 96) that transformers
    writes (config.json, model.safetensors), with an e5-style prompt."""
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    from ingest.model_packages import minilm_dir

    src = minilm_dir()
    shutil.copytree(src, dst)
    for own in ("model.safetensors", "config.json"):  # the tiny model's, written below
        (dst / own).unlink()
    pooling = dst / "1_Pooling" / "config.json"
    spec = json.loads(pooling.read_text())
    spec["word_embedding_dimension"] = TINY_HIDDEN
    pooling.write_text(json.dumps(spec))
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=TINY_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        initializer_range=0.3,
    )
    BertModel(config).eval().save_pretrained(str(dst))
    (dst / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: ", "passage": "passage: "}})
    )
    (dst / "README.md").write_text("---\nlibrary_name: sentence-transformers\n---\n# tiny\n")
    return dst
