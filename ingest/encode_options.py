"""What a manifest records about how a model's inputs and outputs are meant to be used:
sentence-transformers' prompts, the prompt applied when a call names none, and the Matryoshka
widths the model's vectors may be cut to.

Prompts come from the directory (`formats.st_layout`, either layout; a jina-embeddings-v3
config's `task_instructions` are prompts named by task, under the directory's own). Ingest may
add prompts or replace some by name, and name another default, as `SentenceTransformer(prompts=...,
default_prompt_name=...)` does over a saved model: a prompt given by name wins over the
directory's of that name, the others are kept.

Matryoshka widths: those the directory's files record (`formats.matryoshka`: config.json's
`matryoshka_dimensions`, or the MatryoshkaLoss parameters of the model card sentence-transformers
writes after training; config_sentence_transformers.json holds none), unless ingest's
`matryoshka_dims` names others, which win (and settle files that disagree).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.errors import ArtifactInvalid, InvalidRequest
from formats.hf_config import HfConfig
from formats.matryoshka import MatryoshkaError, declared_widths
from formats.st_layout import LayoutError, read_layout


@dataclass(frozen=True)
class EncodeOptions:
    prompts: dict[str, str]
    default_prompt_name: str | None
    matryoshka_dims: list[int]  # widest first
    asked: bool  # some were given at ingest, not only read from the directory


def encode_options(
    model_dir: Path,
    prompts: Mapping[str, str] | None = None,
    default_prompt_name: str | None = None,
    matryoshka_dims: Sequence[int] | None = None,
) -> EncodeOptions:
    """The directory's prompts with ingest's on top, checked before anything is converted."""
    try:
        layout = read_layout(model_dir)
    except LayoutError as e:
        raise ArtifactInvalid(str(e)) from e
    # A task's instruction is the prompt of that name: choosing the default prompt chooses
    # the task (ingest.hf_jina_v3 merges its adapter).
    own_prompts = {**HfConfig.read(model_dir, missing_ok=True).mapping("task_instructions")}
    own_prompts.update(layout.prompts)
    own_dims: list[int] = []
    if not matryoshka_dims:  # widths given at ingest win: the files' are not needed
        try:
            own_dims = declared_widths(model_dir)
        except MatryoshkaError as e:
            raise ArtifactInvalid(f"{e}; name the widths with --matryoshka-dims") from e
    return given_options(
        prompts,
        default_prompt_name,
        matryoshka_dims,
        own_prompts=own_prompts,
        own_default=layout.default_prompt_name,
        own_dims=own_dims,
    )


def given_options(
    prompts: Mapping[str, str] | None = None,
    default_prompt_name: str | None = None,
    matryoshka_dims: Sequence[int] | None = None,
    *,
    own_prompts: Mapping[str, str] | None = None,
    own_default: str | None = None,
    own_dims: Sequence[int] = (),
) -> EncodeOptions:
    """Ingest's options over the model's own (`own_*`: a GGUF has none, so only these)."""
    merged = dict(own_prompts or {})
    if prompts is not None:
        merged.update(_checked_prompts(prompts))
    default = own_default if default_prompt_name is None else default_prompt_name
    if default is not None and default not in merged:
        raise InvalidRequest(
            f"default prompt {default!r} is not one of the model's prompts "
            f"({', '.join(sorted(merged)) or 'it has none'})"
        )
    asked = prompts is not None or default_prompt_name is not None or bool(matryoshka_dims)
    dims = _checked_dims(matryoshka_dims) if matryoshka_dims else list(own_dims)
    return EncodeOptions(merged, default, dims, asked)


def fitted(options: EncodeOptions, kind: str, dims: int) -> EncodeOptions:
    """`options` for the converted model: only an embedder takes prompts and Matryoshka widths,
    and no width may exceed its own."""
    if kind != "embed":
        if options.asked:
            raise InvalidRequest(
                f"prompts and Matryoshka dims are for embedding models; this is a {kind} model"
            )
        return EncodeOptions({}, None, [], False)  # a cross-encoder never applies them
    wider = [d for d in options.matryoshka_dims if d > dims]
    if wider:
        raise InvalidRequest(f"Matryoshka dims {wider} exceed the model's {dims} dims")
    return options


def _checked_prompts(prompts: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(prompts, Mapping):
        raise InvalidRequest("prompts must map prompt names to their text")
    for name, text in prompts.items():
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequest(f"prompt name {name!r}: expected a non-empty name")
        if not isinstance(text, str):
            raise InvalidRequest(f"prompt {name!r}: expected text, got {type(text).__name__}")
    return dict(prompts)


def _checked_dims(dims: Sequence[int] | None) -> list[int]:
    if dims is None:
        return []
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence):
        raise InvalidRequest("Matryoshka dims must be a list of widths")
    bad = [d for d in dims if not isinstance(d, int) or isinstance(d, bool) or d < 1]
    if bad:
        raise InvalidRequest(f"Matryoshka dims must be positive integers, not {bad[0]!r}")
    if len(set(dims)) != len(dims):
        raise InvalidRequest(f"Matryoshka dims {list(dims)} name a width twice")
    return sorted(dims, reverse=True)
