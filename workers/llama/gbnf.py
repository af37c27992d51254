"""A GBNF syntax validator that mirrors llama.cpp's grammar parser (src/llama-grammar.cpp).

Why: llama-cpp-python 0.3.36's `LlamaGrammar.from_string` only stores the text. The parse
happens inside `llama_sampler_init_grammar`, which returns NULL on any error, and
`LlamaSampler.add_grammar` hands that NULL to `llama_sampler_chain_add` — a crash. The parser
is also recursive in C (nested groups, rule chains), so pathological depth can overflow the
native stack. We therefore check every grammar here first, with limits on size and depth, and
still treat a NULL sampler as a refusal. A grammar this accepts but llama.cpp rejects
(e.g. left recursion, `<token>` text that is not exactly one token) is caught by that NULL
check; what this rejects llama.cpp would also reject, or is beyond our limits.

Syntax (as llama.cpp): rules `name ::= alternates` separated by newlines; names
[A-Za-z0-9-]+; `#` comments; elements "literal", [char class] / [^...], rule refs, ( ... ),
`.`, tokens <[id]> / <text> / !<...>; postfix * + ? {m} {m,} {m,n}. Newlines are allowed only
after `::=`, after `|`, and inside parentheses.
"""

from __future__ import annotations

MAX_GRAMMAR_BYTES = 64 * 1024
MAX_NESTING = 64
MAX_REPETITION = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD
# llama.cpp expands `item{m,n}` by copying the item's elements about max(m, n) + 1 times (a
# literal is one element per character), so a 64 KiB grammar could otherwise ask for ~130M
# elements (2 GB). A group or a rule reference is one element: nesting does not multiply.
MAX_EXPANDED_ELEMENTS = 1 << 20


class GrammarError(ValueError):
    """The grammar is not valid GBNF (or exceeds our safety limits)."""


def _is_word(c: str) -> bool:
    return c == "-" or ("a" <= c <= "z") or ("A" <= c <= "Z") or ("0" <= c <= "9")


class _Parser:
    def __init__(self, src: str) -> None:
        self.s = src
        self.defined: set[str] = set()
        self.referenced: dict[str, int] = {}  # name -> offset of first use
        self.expanded = 0  # grammar elements llama.cpp's repetitions will create

    def at(self, i: int) -> str:
        return self.s[i] if i < len(self.s) else ""

    def fail(self, msg: str, i: int) -> GrammarError:
        line = self.s.count("\n", 0, i) + 1
        col = i - (self.s.rfind("\n", 0, i) + 1) + 1
        return GrammarError(f"{msg} at line {line}, column {col}")

    def space(self, i: int, newline_ok: bool) -> int:
        while True:
            c = self.at(i)
            if c in (" ", "\t") or (newline_ok and c in ("\r", "\n")):
                i += 1
            elif c == "#":
                while self.at(i) not in ("", "\r", "\n"):
                    i += 1
            else:
                return i

    def name(self, i: int) -> int:
        j = i
        while _is_word(self.at(j)):
            j += 1
        if j == i:
            raise self.fail("expecting a rule name", i)
        return j

    def integer(self, i: int) -> tuple[int, int]:
        j = i
        while "0" <= self.at(j) <= "9":
            j += 1
        if j == i:
            raise self.fail("expecting an integer", i)
        return int(self.s[i:j]), j

    def char(self, i: int) -> int:
        """One (possibly escaped) character; returns the index after it."""
        c = self.at(i)
        if c == "":
            raise self.fail("unexpected end of input", i)
        if c != "\\":
            return i + 1
        e = self.at(i + 1)
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width is not None:
            digits = self.s[i + 2 : i + 2 + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"expecting {width} hex digits after \\{e}", i)
            return i + 2 + width
        if e in ("t", "r", "n", "\\", '"', "[", "]", "-"):
            return i + 2
        raise self.fail(f"unknown escape \\{e}", i)

    def token(self, i: int) -> int:
        # `<[id]>` or `<text>` (the latter must be one token: llama.cpp checks that).
        i += 1  # '<'
        if self.at(i) == "[":
            value, i = self.integer(i + 1)
            if value > 0xFFFF_FFFF:
                raise self.fail("token id too large", i)
            if self.at(i) != "]" or self.at(i + 1) != ">":
                raise self.fail("expecting ']>'", i)
            return i + 2
        while self.at(i) not in ("", ">"):
            i += 1
        if self.at(i) != ">":
            raise self.fail("expecting '>'", i)
        return i + 1

    def alternates(self, i: int, nested: bool, depth: int) -> int:
        i = self.sequence(i, nested, depth)
        while self.at(i) == "|":
            i = self.space(i + 1, True)
            i = self.sequence(i, nested, depth)
        return i

    def sequence(self, i: int, nested: bool, depth: int) -> int:
        has_item = False
        size = 1  # elements of the last item (what a repetition of it copies)
        while True:
            c = self.at(i)
            if c == '"':
                i += 1
                size = 1
                while self.at(i) != '"':
                    i = self.char(i)
                    size += 1
                i = self.space(i + 1, nested)
                has_item = True
            elif c == "[":
                i += 1
                size = 1
                if self.at(i) == "^":
                    i += 1
                while self.at(i) != "]":
                    i = self.char(i)
                    size += 1
                    if self.at(i) == "-" and self.at(i + 1) != "]":
                        if self.at(i + 1) == "":
                            raise self.fail("unexpected end of input", i)
                        i = self.char(i + 1)
                i = self.space(i + 1, nested)
                has_item = True
            elif c in ("<", "!"):
                if c == "!":
                    i += 1
                    if self.at(i) != "<":
                        raise self.fail("expecting '<' after '!'", i)
                i = self.space(self.token(i), nested)
                has_item, size = True, 1
            elif c and _is_word(c):
                j = self.name(i)
                self.referenced.setdefault(self.s[i:j], i)
                i = self.space(j, nested)
                has_item, size = True, 1
            elif c == "(":
                if depth >= MAX_NESTING:
                    raise self.fail(f"groups nested deeper than {MAX_NESTING}", i)
                i = self.space(i + 1, True)
                i = self.alternates(i, True, depth + 1)
                if self.at(i) != ")":
                    raise self.fail("expecting ')'", i)
                i = self.space(i + 1, nested)
                has_item, size = True, 1
            elif c == ".":
                i = self.space(i + 1, nested)
                has_item, size = True, 1
            elif c in ("*", "+", "?"):
                if not has_item:
                    raise self.fail(f"'{c}' has no preceding item", i)
                self.expand(size * 2, i)
                i = self.space(i + 1, nested)
            elif c == "{":
                if not has_item:
                    raise self.fail("'{' has no preceding item", i)
                i = self.space(i + 1, nested)
                if not ("0" <= self.at(i) <= "9"):
                    raise self.fail("expecting an integer", i)
                lo, i = self.integer(i)
                hi = lo
                i = self.space(i, nested)
                if self.at(i) == "}":
                    i = self.space(i + 1, nested)
                elif self.at(i) == ",":
                    i = self.space(i + 1, nested)
                    if "0" <= self.at(i) <= "9":
                        hi, i = self.integer(i)
                        i = self.space(i, nested)
                    if self.at(i) != "}":
                        raise self.fail("expecting '}'", i)
                    i = self.space(i + 1, nested)
                else:
                    raise self.fail("expecting ',' or '}'", i)
                if max(lo, hi) > MAX_REPETITION:
                    raise self.fail(f"repetition count above {MAX_REPETITION}", i)
                self.expand(size * (max(lo, hi) + 1), i)
            else:
                return i

    def expand(self, elements: int, i: int) -> None:
        self.expanded += elements
        if self.expanded > MAX_EXPANDED_ELEMENTS:
            raise self.fail(
                f"repetitions expand to more than {MAX_EXPANDED_ELEMENTS} grammar elements; "
                "repeat a rule or a group instead of a long literal",
                i,
            )

    def rule(self, i: int) -> int:
        j = self.name(i)
        self.defined.add(self.s[i:j])
        i = self.space(j, False)
        if self.s[i : i + 3] != "::=":
            raise self.fail("expecting '::='", i)
        i = self.space(i + 3, True)
        i = self.alternates(i, False, 0)
        c = self.at(i)
        if c == "\r":
            i += 2 if self.at(i + 1) == "\n" else 1
        elif c == "\n":
            i += 1
        elif c:
            raise self.fail(f"unexpected {c!r} (expecting newline or end)", i)
        return self.space(i, True)


def validate_gbnf(grammar: str, root: str = "root") -> None:
    """Raise GrammarError unless `grammar` is GBNF that llama.cpp's parser accepts."""
    if not isinstance(grammar, str):
        raise GrammarError("grammar must be a string")
    if "\x00" in grammar:
        raise GrammarError("grammar contains a NUL character")  # C would truncate there
    if len(grammar.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"grammar is larger than {MAX_GRAMMAR_BYTES} bytes")
    try:
        grammar.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GrammarError("grammar is not valid Unicode (lone surrogate)") from e
    p = _Parser(grammar)
    i = p.space(0, True)
    while i < len(grammar):
        i = p.rule(i)
    if not p.defined:
        raise GrammarError("grammar defines no rules")
    undefined = sorted(set(p.referenced) - p.defined, key=p.referenced.__getitem__)
    if undefined:
        raise p.fail(f"undefined rule {undefined[0]!r}", p.referenced[undefined[0]])
    if root not in p.defined:
        raise GrammarError(f"grammar has no {root!r} rule")
