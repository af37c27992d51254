"""A checkpoint's chat template as transformers' `apply_chat_template` renders it (a sandboxed
Jinja environment with `trim_blocks`/`lstrip_blocks`, `raise_exception`, its `tojson`,
`strftime_now`, the loop controls), and sentence-transformers' test of whether it can carry a
(query, document) pair at all.

sentence-transformers 6 maps a pair to the messages `query: q`, `document: d` and, before
scoring, renders probe pairs varying one role at a time: a template whose render does not move
with a role's content (one that branches on system/user/assistant only, like a chat model's)
or that raises is refused, since the model would score a prompt holding neither text. Ingest
applies the same probe, so such a checkpoint is refused with that reason rather than served
with every pair scoring alike.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import ArtifactInvalid

# sentence-transformers' PAIR_ROLE_PROBES: a baseline pair, then one per role varying it.
_PROBES = (("alpha", "bravo"), ("charlie", "bravo"), ("alpha", "foxtrot"))


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' override: Jinja's own filter escapes HTML characters.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(template: str) -> jinja2.Template:
    """The template in the environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ArtifactInvalid(f"the model's chat template does not compile: {e}") from e


def pair_roles_failure(
    template: str,
    message_format: Literal["flat", "structured"],
    special_tokens: dict[str, str],
) -> str | None:
    """Why the template cannot carry a query/document pair, None when it can (the module doc)."""
    compiled = compile_template(template)

    def render(query: str, document: str) -> str:
        def content(text: str) -> Any:
            return [{"type": "text", "text": text}] if message_format == "structured" else text

        messages = [
            {"role": "query", "content": content(query)},
            {"role": "document", "content": content(document)},
        ]
        return compiled.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=False,
            **special_tokens,
        )

    try:
        base, *varied = [render(q, d) for q, d in _PROBES]
    except Exception as e:  # sentence-transformers reports whatever the render raised
        return f"it raised {type(e).__name__}: {e}"
    dropped = [role for role, out in zip(("query", "document"), varied, strict=True) if out == base]
    if dropped:
        roles = " and ".join(repr(r) for r in dropped)
        return f"the {roles} content does not reach the rendered prompt"
    return None


def check_pair_roles(
    template: str,
    message_format: Literal["flat", "structured"],
    special_tokens: dict[str, str],
) -> None:
    """ArtifactInvalid when sentence-transformers would refuse to score pairs with `template`."""
    failure = pair_roles_failure(template, message_format, special_tokens)
    if failure is not None:
        raise ArtifactInvalid(
            f"the chat template cannot carry a query/document pair ({failure}): "
            "sentence-transformers' CrossEncoder refuses to score such a model; give it a "
            "template that renders both roles (chat_template.jinja)"
        )
