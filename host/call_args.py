"""The argument checks several Module calls share: prompts (which text is prepended), the
outputs a model serves, and the over-the-limit error worded for the field it is about."""

from __future__ import annotations

from collections.abc import Sequence

from common.errors import InvalidRequest
from ingest.store import ModelRecord, served_outputs


def check_served(record: ModelRecord, kinds: Sequence[str]) -> None:
    """An output the model does not give is refused, naming what it does give."""
    served = served_outputs(record.manifest)
    for kind in kinds:
        if kind not in served:
            what = f"no {kind} head" if kind in ("sparse", "multivector") else f"no {kind} output"
            raise InvalidRequest(
                f"model {record.name!r} has {what}; it serves {', '.join(served)}",
                param="outputs",
                model=record.name,
            )


def renamed(exc: InvalidRequest, old: str, new: str, param: str) -> InvalidRequest:
    """An over-the-limit error of `Tokenizer.encode` worded for the rerank field it is about."""
    if "n_tokens" not in exc.details:
        return exc
    details = {**exc.details, "param": param}
    return InvalidRequest(exc.message.replace(old, new, 1), **details)


#####
def check_prompt_args(prompt_name: str | None, prompt: str | None) -> None:
    if prompt_name is not None and prompt is not None:
        raise InvalidRequest("pass prompt_name or prompt, not both", param="prompt")
    if prompt_name is not None and not isinstance(prompt_name, str):
        raise InvalidRequest(
            f"prompt_name must be a string, got {type(prompt_name).__name__}", param="prompt_name"
        )
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidRequest(
            f"prompt must be a string, got {type(prompt).__name__}", param="prompt"
        )


def resolve_prompt(record: ModelRecord, prompt_name: str | None, prompt: str | None) -> str:
    """The text prepended to every input: `prompt`, else the model's prompt `prompt_name`,
    else its default prompt, else ""."""
    if prompt is not None:
        return prompt
    man = record.manifest
    name = man.default_prompt_name if prompt_name is None else prompt_name
    if name is None:
        return ""
    if name not in man.prompts:
        known = ", ".join(repr(n) for n in sorted(man.prompts)) or "none"
        raise InvalidRequest(
            f"model {record.name!r} has no prompt named {name!r}; its prompts: {known}",
            param="prompt_name",
            model=record.name,
            prompts=sorted(man.prompts),
        )
    return man.prompts[name]
