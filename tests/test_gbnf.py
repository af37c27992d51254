"""The GBNF validator's limits: what llama.cpp would reject, and what it would accept but
expand beyond reason (a repeated long literal allocates gigabytes inside the worker)."""

from __future__ import annotations

import pytest

from workers.llama.gbnf import GrammarError, validate_gbnf


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= ("yes" | "no")',
        'root ::= "Answer: " [0-9]+ "."',
        'root ::= [0-9]{1,10} ("-" [a-z]{3}){0,5}',
        # A group is one element however large: repeating it copies a reference, not its body.
        'root ::= ("' + "a" * 60_000 + '"){2000}',
        'root ::= item{2000}\nitem ::= "' + "b" * 60_000 + '"',
        'root ::= "' + "c" * 500 + '"{2000}',  # ~1M elements: just inside the bound
    ],
)
def test_accepted(grammar: str) -> None:
    validate_gbnf(grammar)


@pytest.mark.parametrize(
    "grammar, match",
    [
        ('root ::= "a"{2001}', "repetition count above 2000"),
        ('root ::= "a"{0,2001}', "repetition count above 2000"),  # llama.cpp checks the max too
        ('root ::= "' + "a" * 65_000 + '"{2000}', "expand to more than"),  # ~130M elements
        ("root ::= [" + "a" * 1000 + "]{2000}", "expand to more than"),
        ('root ::= "' + "a" * 600 + '"{1000} "' + "b" * 600 + '"{1000}', "expand to more than"),
    ],
)
def test_refused(grammar: str, match: str) -> None:
    with pytest.raises(GrammarError, match=match):
        validate_gbnf(grammar)
