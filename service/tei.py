"""Hugging Face Text Embeddings Inference's shapes: `POST /embed` and `GET /info` (TEI's
rerank is `POST /rerank`, service/rerank.py; its tokenizer routes are service/tokens.py).

`/embed` takes `inputs` (a string, a list of strings, or token arrays as /v1/embeddings
does), `normalize`, `truncate`, `truncation_direction`, `prompt_name` (and the extension
`prompt`, the text itself), `dimensions` (Matryoshka models only) and the extension `model`
(TEI serves one model; here it defaults to the default embedding model). The body is TEI's
bare list of vectors, so what is per input goes in headers: `X-Synapse-Model`,
`X-Synapse-Truncated` (the indices of the inputs that were cut, comma-separated; empty when
none) and `X-Synapse-Tokens` (tokens embedded in all); `/v1/embeddings` has `n_tokens` and
`truncated` on every item. Unlike TEI (whose default is the server's `--auto-truncate`),
`truncate` defaults to true, as on every route here.

`/info` describes one model (`?model=NAME`, default: the default embedding model) with TEI's
fields, plus the model's `default_prompt_name`, `dims` and `max_tokens_limit` (the longest
limit a request may ask for, beside `max_input_length`, the limit inputs are cut at).
"""

from __future__ import annotations

import importlib.metadata
from typing import Annotated, Any

import msgspec
import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response

from common.errors import InvalidRequest, SynapseError
from service.embeddings import (
    _INPUT_SCHEMA,
    apply_dimensions,
    is_matryoshka,
    parse_input,
    refuse_prompt_for_ids,
)
from service.state import ServerState
from service.truncation import Direction, direction, name_field

_NUMPY = orjson.OPT_SERIALIZE_NUMPY


class TeiEmbedRequest(msgspec.Struct, kw_only=True):
    inputs: Annotated[Any, msgspec.Meta(extra_json_schema=_INPUT_SCHEMA)]
    normalize: bool = True
    truncate: bool | None = None  # null: the default, true
    truncation_direction: Direction = "right"
    prompt_name: str | None = None
    prompt: str | None = None  # extension: the text to prepend ("": none)
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    model: str | None = None  # extension


class _Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class TeiEmbeddingModel(_Body):
    pooling: str


class TeiClassifierModel(_Body):
    id2label: dict[str, str]
    label2id: dict[str, int]


class TeiModelType(_Body):
    embedding: TeiEmbeddingModel | None = None
    classifier: TeiClassifierModel | None = None
    reranker: TeiClassifierModel | None = None


class TeiInfo(_Body):
    model_id: str
    model_sha: str | None
    model_dtype: str
    model_type: TeiModelType
    prompts: dict[str, str] | None
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None
    docker_label: str | None
    # extensions
    default_prompt_name: str | None = None
    dims: int | None = None
    max_tokens_limit: int | None = None


async def embed(request: Request, state: ServerState) -> Response:
    req = await state.read_json(request, TeiEmbedRequest)
    try:
        texts, token_arrays = parse_input(req.inputs)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message.replace("input", "inputs", 1), param="inputs") from None
    model = state.resolve(req.model, state.config.default_model)
    sched = state.scheduler
    assert sched is not None
    truncate = True if req.truncate is None else req.truncate
    try:
        if texts is not None:
            result = await sched.embed_texts(
                texts,
                model,
                req.normalize,
                truncate,
                prompt_name=req.prompt_name,
                prompt=req.prompt,
                direction=direction(req.truncation_direction),
            )
        else:
            refuse_prompt_for_ids(req.prompt_name, req.prompt)
            result = await sched.embed_ids(token_arrays or [], model, req.normalize)
    except SynapseError as exc:
        if exc.details.get("param") == "input":
            exc.details["param"] = "inputs"
        raise name_field(exc, "inputs") from None
    matryoshka = req.dimensions is not None and is_matryoshka(state, model)
    vectors = apply_dimensions(result.vectors, req.dimensions, model, matryoshka)
    headers = {
        "X-Synapse-Model": result.model,
        "X-Synapse-Tokens": str(result.total_tokens),
        "X-Synapse-Truncated": ",".join(str(i) for i, cut in enumerate(result.truncated) if cut),
    }
    # float32's shortest round-trip JSON numbers, as /v1/embeddings writes them.
    body = orjson.dumps(np.ascontiguousarray(vectors, np.float32), option=_NUMPY)
    return Response(body, media_type="application/json", headers=headers)


async def info(request: Request, state: ServerState) -> Response:
    model = state.resolve(request.query_params.get("model"), state.config.default_model)
    assert state.module is not None
    record = state.module.record(model)
    man = record.manifest
    if man.kind == "embed":
        kind = TeiModelType(embedding=TeiEmbeddingModel(pooling=man.pooling or "mean"))
        concurrent = state.config.scheduler.max_queue_items
    elif man.kind == "rerank":
        # TEI's rule: one label is a reranker, several a classifier (served by /predict).
        labels = state.module.labels(model)
        head = TeiClassifierModel(
            id2label={str(i): label for i, label in enumerate(labels)},
            label2id={label: i for i, label in enumerate(labels)},
        )
        kind = TeiModelType(reranker=head) if len(labels) == 1 else TeiModelType(classifier=head)
        concurrent = state.config.scheduler.max_pending
    else:
        raise InvalidRequest(
            f"model {model!r} is a {man.kind} model; /info describes embedding and rerank models",
            param="model",
        )
    body = TeiInfo(
        model_id=model,
        model_sha=record.digest or None,
        model_dtype=man.dtype or "unknown",
        model_type=kind,
        prompts=dict(man.prompts) or None,
        max_concurrent_requests=concurrent,
        max_input_length=man.max_tokens,
        max_batch_tokens=state.config.scheduler.max_batch_tokens,
        max_batch_requests=None,
        max_client_batch_size=state.config.module.budgets.max_inputs,
        auto_truncate=True,
        tokenization_workers=1,
        version=_version(),
        sha=None,
        docker_label=None,
        default_prompt_name=man.default_prompt_name,
        dims=man.dims,
        max_tokens_limit=man.max_tokens_limit,
    )
    return Response(msgspec.json.encode(body), media_type="application/json")


def _version() -> str:
    try:
        return importlib.metadata.version("synapse")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
