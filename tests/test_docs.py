"""The repository's docs are true to the code: the serve config they show loads, every
environment variable and metric they name exists (and every one the code reads is documented),
every `synapse ...` command line they show parses, and nothing points outside the repository."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import msgspec
import pytest

from cli.main import build_parser
from service.config import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ["host", "workers", "compile_cache", "certification", "formats", "ingest", "service",
             "batch", "cli", "scripts"]


def _code_text() -> str:
    return "\n".join(p.read_text() for d in CODE_DIRS for p in (ROOT / d).rglob("*.py"))


def _fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_the_documented_serve_config_loads_key_for_key():
    (block,) = _fenced((ROOT / "docs" / "operations.md").read_text(), "toml")
    # Every key is known (unknown ones are errors at every level) and every value valid.
    config = msgspec.convert(tomllib.loads(block), ServeConfig)
    assert config.aliases == {"text-embedding-3-small": "minilm-l6-v2"}


def test_a_typo_in_a_nested_table_is_an_error():
    with pytest.raises(msgspec.ValidationError, match="n_thread|unknown"):
        msgspec.convert({"module": {"host": {"inference_window": 1}}}, ServeConfig)


def test_every_environment_variable_is_documented_and_exists():
    documented = set(re.findall(r"\bSYNAPSE_[A-Z_]+\b", (ROOT / "docs" / "operations.md")
                                .read_text()))
    read_by_code = set(re.findall(r"\bSYNAPSE_[A-Z_]+\b", _code_text()))
    assert read_by_code - documented == set()
    assert documented - read_by_code == set()


def test_every_documented_metric_is_exported():
    text = (ROOT / "docs" / "operations.md").read_text()
    documented = {re.sub(r"_total$", "", m) for m in re.findall(r"`(synapse_[a-z_]+)`", text)}
    exported = set(re.findall(r'"(synapse_[a-z_]+)"', (ROOT / "service" / "metrics.py")
                              .read_text()))
    assert documented == exported


def _command_lines() -> list[tuple[str, list[str]]]:
    found = []
    for doc in DOCS:
        for block in _fenced(doc.read_text(), "sh"):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                words = shlex.split(line) if line else []
                if words and words[0].endswith("synapse"):
                    found.append((f"{doc.name}: {line}", words[1:]))
    return found


@pytest.mark.parametrize("where, argv", _command_lines(), ids=lambda v: str(v)[:60])
def test_every_documented_command_line_parses(where, argv):
    parser = build_parser()
    # Alternatives written as a|b|c or [OPTIONAL] are documentation, not one command line:
    # take the first alternative of each and drop the optional parts.
    if "|" in argv:
        argv = argv[: argv.index("|")]
    argv = [w.split("|")[0] for w in argv if not w.startswith("[") and not w.endswith("]")]
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: does not parse (exit {e.code})")


def test_nothing_points_outside_the_repository():
    for doc in DOCS:
        assert "../shared" not in doc.read_text(), doc
        for target in re.findall(r"\]\(([^)#]+)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def _bullets(doc: Path, heading: str) -> list[str]:
    """The top-level bullets (continuation lines joined) of one `## heading` section."""
    text = doc.read_text()
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"{doc.name} has no '## {heading}' section"
    return [" ".join(b.split()) for b in re.findall(r"^- (.*?)(?=^- |^\S|\Z)", match.group(1),
                                                    re.S | re.M)]


@pytest.mark.parametrize("heading", ["Not built", "Where this differs from the protocol "
                                                   "specification"])
def test_every_protocol_departure_names_itself_and_its_reason(heading):
    items = _bullets(ROOT / "docs" / "protocol.md", heading)
    assert items
    for item in items:
        name = re.match(r"\*\*(.+?)\*\*", item)
        assert name, f"'{item[:60]}...' does not start with the part it is about, in bold"
        reason = item.split("Why:", 1)[1] if "Why:" in item else ""
        assert len(reason.split()) >= 8, f"{name.group(1)}: no reason given ('Why: ...')"


def test_the_parts_of_the_protocol_left_unbuilt_are_listed_and_really_absent():
    names = " ".join(re.match(r"\*\*(.+?)\*\*", item).group(1)
                     for item in _bullets(ROOT / "docs" / "protocol.md", "Not built"))
    for part in ("probe_required", "owned-decode supervisor", "Streaming generation",
                 "Named pipes", "Worker pools per model", "TLS"):
        assert part in names, f"docs/protocol.md 'Not built' does not account for {part}"
    # Listed as not built, so nothing builds them: a change that does must update the page.
    from workers.protocol import messages as m

    assert "probe_required" not in _code_text()
    assert not any("stream" in f for f in m.GENERATE.__struct_fields__)
    assert not any("stream" in f for f in m.TEXT.__struct_fields__)
