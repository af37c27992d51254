"""The repository's docs are true to the code: the serve config they show loads, every
environment variable and metric they name exists (and every one the code reads is documented),
every metric's type and labels are the code's, every alternative of every `synapse ...` command
line they show parses, nothing points outside the repository, and no code comment cites a
document the repository does not hold (design sections, issue numbers)."""

from __future__ import annotations

import ast
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
CODE_DIRS = [
    "bench",
    "host",
    "workers",
    "compile_cache",
    "certification",
    "formats",
    "ingest",
    "service",
    "batch",
    "cli",
    "scripts",
]


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
    documented = set(
        re.findall(r"\bSYNAPSE_[A-Z_]+\b", (ROOT / "docs" / "operations.md").read_text())
    )
    read_by_code = set(re.findall(r"\bSYNAPSE_[A-Z_]+\b", _code_text()))
    assert read_by_code - documented == set()
    assert documented - read_by_code == set()


def test_every_documented_metric_is_exported():
    text = (ROOT / "docs" / "operations.md").read_text()
    documented = {re.sub(r"_total$", "", m) for m in re.findall(r"`(synapse_[a-z_]+)`", text)}
    assert documented == set(_code_metrics())


# prometheus_client's metric classes (the instrumented ones and the custom collector's
# families) by the type they expose; a counter's samples carry `_total` after its name.
_METRIC_TYPES = {
    "Counter": "counter",
    "CounterMetricFamily": "counter",
    "Gauge": "gauge",
    "GaugeMetricFamily": "gauge",
    "Histogram": "histogram",
    "HistogramMetricFamily": "histogram",
    "Summary": "summary",
}


def _code_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """name -> (type, label names) of every metric service/metrics.py defines, read from the
    definitions themselves: `Counter(name, doc, labelnames)` or `...MetricFamily(name, doc,
    labels=...)`."""
    tree = ast.parse((ROOT / "service" / "metrics.py").read_text())
    found = {}
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _METRIC_TYPES
        ):
            continue
        name = ast.literal_eval(node.args[0])
        labels = node.args[2] if len(node.args) > 2 else None
        for kw in node.keywords:
            if kw.arg in ("labelnames", "labels"):
                labels = kw.value
        found[name] = (
            _METRIC_TYPES[node.func.id],
            frozenset(ast.literal_eval(labels)) if labels is not None else frozenset(),
        )
    return found


def _documented_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """name -> (type, label names) from the metrics table of docs/operations.md: `| names |
    type | labels | meaning |`, a label's values in parentheses after it."""
    found = {}
    for row in re.findall(
        r"^\|(.*`synapse_.*)\|$", (ROOT / "docs" / "operations.md").read_text(), re.M
    ):
        names, kind, labels, _ = (cell.strip() for cell in row.split("|"))
        labels = re.sub(r"\([^)]*\)", "", labels)
        label_set = frozenset(w.strip() for w in labels.split(",") if w.strip())
        for name in re.findall(r"`(synapse_[a-z_]+)`", names):
            # A counter's definition names it without the `_total` its samples carry.
            found[re.sub(r"_total$", "", name) if kind == "counter" else name] = (kind, label_set)
    return found


def test_every_metric_is_documented_with_its_type_and_labels():
    documented, code = _documented_metrics(), _code_metrics()
    assert len(code) >= 20, "the metric definitions were not found"
    differ = {
        name: {"docs": documented.get(name), "code": code.get(name)}
        for name in documented.keys() | code.keys()
        if documented.get(name) != code.get(name)
    }
    assert differ == {}


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


# ---- every alternative of a documented command line -------------------------------------
# A documented line is a small grammar: `[...]` is optional, `a|b` inside a word and a
# standalone `|` are alternatives. `synapse cache ls | du | gc [--budget SIZE]` means
# `synapse cache ls`, `synapse cache du`, `synapse cache gc --budget SIZE`: the first
# alternative of a standalone `|` is the last plain word before it, what precedes it is shared.


def _tokens(words: list[str]) -> list[str]:
    out = []
    for word in words:
        lead = len(word) - len(word.lstrip("["))
        core = word.lstrip("[")
        trail = len(core) - len(core.rstrip("]"))
        core = core.rstrip("]")
        out += ["["] * lead + ([core] if core else []) + ["]"] * trail
    return out


def _parse_alternatives(tokens: list[str], i: int, top: bool) -> tuple[list, int]:
    """("alt", [seq, ...]) up to a closing `]` (or the end); a seq is a list of nodes: a word's
    alternatives ("word", [w, ...]), ("opt", alt) or a nested ("alt", ...)."""
    seqs, seq = [], []
    while i < len(tokens) and tokens[i] != "]":
        tok = tokens[i]
        if tok == "|":
            seqs.append(seq)
            seq = []
            i += 1
        elif tok == "[":
            inner, i = _parse_alternatives(tokens, i + 1, top=False)
            assert i < len(tokens) and tokens[i] == "]", f"unclosed [ in {tokens}"
            seq.append(("opt", inner))
            i += 1
        else:
            seq.append(("word", tok.split("|")))
            i += 1
    seqs.append(seq)
    if top and len(seqs) > 1:
        first = seqs[0]
        start = max(
            k
            for k, node in enumerate(first)
            if node[0] == "word" and not node[1][0].startswith("-")
        )
        shared, seqs[0] = first[:start], first[start:]
        return ("seq", [*shared, ("alt", seqs)]), i
    return ("alt", seqs), i


def _variants(node) -> list[list[str]]:
    """Argument lists in which every alternative and every optional part appears at least
    once (one choice varied at a time, the others at their first; optional parts present, and
    once all absent)."""
    kind, body = node
    if kind == "word":
        return [[w] for w in body]
    if kind == "opt":
        return [*_variants(body), []]
    if kind == "alt":
        return [v for seq in body for v in _variants(("seq", seq))]
    options = [_variants(child) for child in body]  # "seq"
    base = [opts[0] for opts in options]
    out = [[w for part in base for w in part]]
    for k, opts in enumerate(options):
        for alternative in opts[1:]:
            out.append([w for part in (*base[:k], alternative, *base[k + 1 :]) for w in part])
    bare = [[] if child[0] == "opt" else opts[0] for child, opts in zip(body, options, strict=True)]
    out.append([w for part in bare for w in part])
    return [list(v) for v in dict.fromkeys(map(tuple, out))]


def _command_variants() -> list[tuple[str, list[str]]]:
    cases = []
    for where, argv in _command_lines():
        tree, end = _parse_alternatives(_tokens(argv), 0, top=True)
        assert end == len(_tokens(argv)), f"{where}: unbalanced ]"
        cases += [(where, variant) for variant in _variants(tree)]
    return cases


def test_alternatives_expand_to_every_choice():
    tree, _ = _parse_alternatives(
        _tokens(shlex.split("cache ls | gc [--budget SIZE] | embed x [--lane llama|ane]")),
        0,
        top=True,
    )
    assert sorted(map(" ".join, _variants(tree))) == [
        "cache embed x",
        "cache embed x --lane ane",
        "cache embed x --lane llama",
        "cache gc",
        "cache gc --budget SIZE",
        "cache ls",
    ]


@pytest.mark.parametrize(
    "where, argv",
    _command_variants(),
    ids=lambda v: " ".join(v)[:70] if isinstance(v, list) else v.split(":")[0],
)
def test_every_documented_command_line_parses(where, argv):
    # Placeholders stand for what the reader types; the parser checks their form too.
    argv = [{"SIZE": "10G"}.get(word, word) for word in argv]
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: {' '.join(argv)!r} does not parse (exit {e.code})")


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
    return [
        " ".join(b.split())
        for b in re.findall(r"^- (.*?)(?=^- |^\S|\Z)", match.group(1), re.S | re.M)
    ]


@pytest.mark.parametrize(
    "heading", ["Not built", "Where this differs from the protocol specification"]
)
def test_every_protocol_departure_names_itself_and_its_reason(heading):
    items = _bullets(ROOT / "docs" / "protocol.md", heading)
    assert items
    for item in items:
        name = re.match(r"\*\*(.+?)\*\*", item)
        assert name, f"'{item[:60]}...' does not start with the part it is about, in bold"
        reason = item.split("Why:", 1)[1] if "Why:" in item else ""
        assert len(reason.split()) >= 8, f"{name.group(1)}: no reason given ('Why: ...')"


def test_the_parts_of_the_protocol_left_unbuilt_are_listed_and_really_absent():
    names = " ".join(
        re.match(r"\*\*(.+?)\*\*", item).group(1)
        for item in _bullets(ROOT / "docs" / "protocol.md", "Not built")
    )
    for part in (
        "probe_required",
        "owned-decode supervisor",
        "Streaming generation",
        "Named pipes",
        "Worker pools per model",
        "TLS",
    ):
        assert part in names, f"docs/protocol.md 'Not built' does not account for {part}"
    # Listed as not built, so nothing builds them: a change that does must update the page.
    from workers.protocol import messages as m

    assert "probe_required" not in _code_text()
    assert not any("stream" in f for f in m.GENERATE.__struct_fields__)
    assert not any("stream" in f for f in m.TEXT.__struct_fields__)


# A comment must state its reason, not point at a text the repository's readers never see: a
# design document's numbered parts, a tracker's numbers, the first specification. The pattern
# and its examples are spelled in pieces so that this file is scanned like every other.
_DOC = "DES" + "IGN"
_CITATIONS = re.compile(
    rf"\b{_DOC}\b|\b(?:[Ii]ssue|PR|[Pp]ull request)s? ?#?\d|\b[Ss]ection \d"
    r"|\u00a7|\b[Tt]he (?:issue|seed|spec)\b"
)
CITATION_DIRS = [*CODE_DIRS, "tests"]


def test_no_code_comment_cites_a_document_outside_the_repository():
    cited = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for d in CITATION_DIRS
        for p in sorted((ROOT / d).rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if _CITATIONS.search(line)
    ]
    assert cited == []


@pytest.mark.parametrize(
    "line",
    [
        f"see {_DOC} sect" + "ion 3",
        "(iss" + "ue 10, sect" + "ion 6)",
        "iss" + "ue #14",
        "the iss" + "ue's tolerance",
        f"{_DOC} 8: most FLOPs",
        "written from the se" + "ed",
        "\u00a75",
    ],
)
def test_the_citation_check_catches_citations(line):
    assert _CITATIONS.search(line)
