"""RocketMQ's SQL92 property filter: a subscription such as ``region = 'eu' AND amount > 100``.

A consumer subscribes with ``FilterExpression(expr, SQL92)`` (brokers with ``enablePropertyFilter``);
the expression is compiled once and tested against each message's properties: the user's and the
system ones (TAGS, KEYS, UNIQ_KEY, ...), all strings. The dialect and its results follow RocketMQ's
filter module (an ActiveMQ selector grammar), written here from its rules:

- ``AND``, ``OR``, ``NOT`` in three-valued logic; a message is selected only when the whole expression
  is TRUE. A missing property is NULL: ``a = 1`` and ``a <> 1`` are both unknown, ``a IS NULL`` is TRUE.
- ``=``, ``<>``, ``>``, ``>=``, ``<``, ``<=``, ``[NOT] BETWEEN x AND y``, ``[NOT] IN ('a', 'b')``,
  ``IS [NOT] NULL``, ``[NOT] CONTAINS | STARTSWITH | ENDSWITH 'text'``; literals ``'text'`` (``''`` is a
  quote), integers (``L`` suffix allowed, but not on ``0``: RocketMQ reads ``0L`` as ``0`` then a name ``L``),
  decimals, ``TRUE``, ``FALSE``, ``NULL``; keywords in any case.
- A property compared with a number is read as that number's Java type (``Integer.valueOf``,
  ``Long.valueOf``, ``Double.valueOf``); ``>`` and friends between two properties compare them as doubles.
  A property that is not such a number makes the expression fail for that message, which is then not
  selected (RocketMQ logs it and skips the message). As in Java, an integer may have any number of leading
  zeros (and is out of range past 64 bits however long), and a double too large is infinity, hex ones too.
- What RocketMQ refuses when it parses, this refuses with ``InvalidFilterError``: ``a = NULL``, ``'x' > a``,
  ``BETWEEN 5 AND 1``, ``5 IN ('5')``, a bare number, an integer beyond 64 bits, and ``0.0`` (RocketMQ rejects a
  decimal below ``Double.MIN_VALUE``, so zero too: kept, so what works here works on a broker).

Limits: an expression nested more than ``MAX_DEPTH`` (128) deep is refused: parentheses and the NOT or signs
before them, and operators whose operand is another's result (``a = (b = (c = 1))``); a chain of AND or OR counts
once however long. Parsing and matching then take at most ``5 * MAX_DEPTH + 20`` of Python's 1,000 frames, leaving
a caller 300 (RocketMQ, on Java's stack, accepts hundreds of levels; no hand-written filter comes near either).
Property texts and expressions are read in linear time, and a refused expression is remembered like a compiled one.

One deliberate difference: RocketMQ stops parsing after the first complete expression and ignores what
follows (``a = 1 b = 2`` selects on ``a = 1``); here anything after it is an error, since it always is
one in the subscriber's code.
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .errors import InvalidQueryError


class InvalidFilterError(InvalidQueryError):
    """An SQL92 filter expression that does not parse, or that RocketMQ would refuse."""


class _EvalError(Exception):
    """The expression cannot be evaluated for this message (RocketMQ: an exception, the message is skipped)."""


# --- values: Java's types, as RocketMQ's expressions see them --------------------------------------------------


class Int(int):
    """A java.lang.Integer (a literal that fits 32 bits)."""

    __slots__ = ()


class Long(int):
    """A java.lang.Long."""

    __slots__ = ()


_INT_RANGE = (-(1 << 31), (1 << 31) - 1)
_LONG_RANGE = (-(1 << 63), (1 << 63) - 1)
_DOUBLE_MIN = 5e-324  # Double.MIN_VALUE: the smallest positive double


def _kind(value: object) -> type:
    return type(value)


def _java_int(text: str, low: int, high: int) -> int:
    """Integer.valueOf / Long.valueOf: an optional sign and decimal digits (any script's, as Character.digit reads
    them), nothing else, in range. Leading zeros are dropped before converting: Java takes any number of them,
    and int() refuses more than 4,300 digits."""
    body = text[1:] if text[:1] in "+-" else text
    if not body or not body.isdecimal():
        raise _EvalError(f"{text!r} is not an integer")
    digits = body.lstrip("0")
    if not digits.isascii():  # another script's zeros: a loop, but only over the zeros
        start = 0
        while start < len(digits) and unicodedata.digit(digits[start]) == 0:
            start += 1
        digits = digits[start:]
    if len(digits) > 19:  # past 64 bits whatever the digits
        raise _EvalError(f"{text[:40]!r}... is out of range")
    value = -int(digits or "0") if text[:1] == "-" else int(digits or "0")
    if not low <= value <= high:
        raise _EvalError(f"{text!r} is out of range")
    return value


# Java's FloatingDecimal text. Each run of digits has one way to match (``\d+(\.\d*)?``, not ``\d+\.?\d*``, whose
# two digit runs can split a long number n ways and made a failing match quadratic: 13 s for 16,000 digits)
_DECIMAL_TEXT = re.compile(r"[+-]?(NaN|Infinity|(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?[fFdD]?)", re.ASCII)
_HEX_TEXT = re.compile(r"[+-]?0[xX]([0-9a-fA-F]+(\.[0-9a-fA-F]*)?|\.[0-9a-fA-F]+)[pP][+-]?\d+[fFdD]?", re.ASCII)


def _java_double(text: str) -> float:
    """Double.valueOf: Java's floating-point text (trimmed of control characters and spaces)."""
    trimmed = text.strip("".join(map(chr, range(33))))
    if _DECIMAL_TEXT.fullmatch(trimmed):
        if trimmed.endswith("NaN"):
            return math.nan
        if trimmed.endswith("Infinity"):
            return -math.inf if trimmed.startswith("-") else math.inf
        return float(trimmed.rstrip("fFdD"))
    if _HEX_TEXT.fullmatch(trimmed):
        try:
            return float.fromhex(trimmed.rstrip("fFdD"))
        except OverflowError:  # Java rounds a hex value past Double.MAX_VALUE to infinity, as it does a decimal
            return -math.inf if trimmed.startswith("-") else math.inf
    raise _EvalError(f"{text!r} is not a number")


def _java_bool(text: str) -> bool:
    return text.lower() == "true"  # Boolean.valueOf


def _double_compare(a: float, b: float) -> int:
    """Double.compareTo: NaN above everything (and equal to itself), -0.0 below 0.0."""
    if math.isnan(a) or math.isnan(b):
        return (math.isnan(a) > math.isnan(b)) - (math.isnan(a) < math.isnan(b))
    if a == b == 0.0:
        a, b = math.copysign(1.0, a), math.copysign(1.0, b)
    return (a > b) - (a < b)


def _compare(lv: object, rv: object) -> int:
    """ComparisonExpression's ``__compare`` with string conversion on: widen a number, read a string as the
    other side's type; -1 for pairs it does not know how to compare."""
    lc, rc = _kind(lv), _kind(rv)
    if lc is not rc:
        if lc is bool:
            if rc is str:  # RocketMQ casts the Boolean to String here: a ClassCastException
                raise _EvalError("a boolean compared with a string")
            return -1
        if lc is Int:
            if rc is Long:
                lv = Long(lv)
            elif rc is float:
                lv = float(lv)  # type: ignore[arg-type]
            elif rc is str:
                rv = Int(_java_int(rv, *_INT_RANGE))  # type: ignore[arg-type]
            else:
                return -1
        elif lc is Long:
            if rc is Int:
                rv = Long(rv)
            elif rc is float:
                lv = float(lv)  # type: ignore[arg-type]
            elif rc is str:
                rv = Long(_java_int(rv, *_LONG_RANGE))  # type: ignore[arg-type]
            else:
                return -1
        elif lc is float:
            if rc in (Int, Long):
                rv = float(rv)  # type: ignore[arg-type]
            elif rc is str:
                rv = _java_double(rv)  # type: ignore[arg-type]
            else:
                return -1
        elif lc is str:
            if rc is bool:
                lv = _java_bool(lv)  # type: ignore[arg-type]
            elif rc is Int:
                lv = Int(_java_int(lv, *_INT_RANGE))  # type: ignore[arg-type]
            elif rc is Long:
                lv = Long(_java_int(lv, *_LONG_RANGE))  # type: ignore[arg-type]
            elif rc is float:
                lv = _java_double(lv)  # type: ignore[arg-type]
            else:
                return -1
        else:
            return -1
    if type(lv) is float:
        return _double_compare(lv, rv)  # type: ignore[arg-type]
    if type(lv) is str:  # String.compareTo: UTF-16 code units
        left, right = lv.encode("utf-16-be", "surrogatepass"), rv.encode("utf-16-be", "surrogatepass")  # type: ignore[union-attr]
        return (left > right) - (left < right)
    return (lv > rv) - (lv < rv)  # type: ignore[operator]


def _java_equals(lv: object, rv: object) -> bool:
    if type(lv) is not type(rv):
        return False
    if type(lv) is float:  # Double.equals compares bits: NaN equals NaN, 0.0 does not equal -0.0
        return _double_compare(lv, rv) == 0  # type: ignore[arg-type]
    return lv == rv


# --- expressions ---------------------------------------------------------------------------------------------

Props = Mapping[str, str]
Evaluate = Callable[[Props], object]


@dataclass(frozen=True)
class _Node:
    """A parsed expression: how to evaluate it and what RocketMQ's parser knows about it."""

    evaluate: Evaluate
    boolean: bool = False  # a BooleanExpression (comparisons, logic, TRUE/FALSE/NULL)
    constant: bool = False
    value: object = None  # the constant's value
    prop: str | None = None  # a property reference
    text: str = ""
    depth: int = 0  # how deep evaluating it recurses below a value (a property or a literal: 0)
    op: str = ""  # "AND" / "OR" for a chain of them
    operands: tuple[_Node, ...] = ()

    def __str__(self) -> str:
        return self.text


# Nesting: parentheses and the prefix operators before them while parsing, operators over operators once
# parsed (a chain of AND or OR counts once, however long). A parenthesis costs the parser five Python frames and a
# level costs evaluation one, so MAX_DEPTH levels take at most 5 * MAX_DEPTH + 20 of the interpreter's 1,000
# (sys.getrecursionlimit()), leaving the caller over 300. RocketMQ's JavaCC parser accepts more, into the
# hundreds; no one writes that by hand.
MAX_DEPTH = 128


def _node(evaluate: Evaluate, *children: _Node, **fields: object) -> _Node:
    depth = 1 + max((child.depth for child in children), default=0)
    if depth > MAX_DEPTH:
        raise InvalidFilterError(f"the SQL92 filter is nested more than {MAX_DEPTH} deep")
    return _Node(evaluate, depth=depth, **fields)  # type: ignore[arg-type]


def _constant(value: object, text: str) -> _Node:
    return _Node(lambda _props: value, boolean=value is None or type(value) is bool, constant=True, value=value,
                 text=text)


def _property(name: str) -> _Node:
    return _Node(lambda props: props.get(name), prop=name, text=name)


def _as_boolean(node: _Node) -> _Node:
    """asBooleanExpression: a property is cast (TRUE only for a Boolean, so never for a string), a non-boolean
    expression is refused."""
    if node.boolean:
        return node
    if node.prop is not None:
        get = node.evaluate

        def cast(props: Props) -> object:
            value = get(props)
            return None if value is None else value is True

        return _node(cast, node, boolean=True, text=node.text)
    raise InvalidFilterError(f"expression will not result in a boolean value: {node}")


def _check_less_than_operand(node: _Node) -> None:
    if node.constant:
        if type(node.value) in (Int, Long, float):
            return
        raise InvalidFilterError(f"value {node} cannot be compared")
    if node.boolean:
        raise InvalidFilterError(f"value {node} cannot be compared")


def _logic(op: str, *nodes: _Node) -> _Node:
    """AND / OR. A chain (``a AND b AND c``) is one node evaluated in a loop, in the order and with the short
    cut of RocketMQ's left-deep tree, so a long generated chain costs no recursion."""
    decisive = op == "OR"  # the operand value that decides the chain: TRUE for OR, FALSE for AND
    operands = tuple(part for node in nodes for part in (node.operands if node.op == op else (node,)))
    steps = tuple(node.evaluate for node in operands)

    def evaluate(props: Props) -> object:
        unknown = False
        for step in steps:
            value = step(props)
            if value is decisive:
                return decisive
            unknown = unknown or value is None
        return None if unknown else not decisive

    return _node(evaluate, *operands, boolean=True, op=op, operands=operands,
                 text=f" {op} ".join(str(node) for node in operands))


def _logic_not(node: _Node) -> _Node:
    f = node.evaluate

    def evaluate(props: Props) -> object:
        value = f(props)
        return None if value is None else not value

    return _node(evaluate, node, boolean=True, text=f"NOT {node}")


def _equal_unchecked(left: _Node, right: _Node) -> _Node:
    lf, rf = left.evaluate, right.evaluate

    def evaluate(props: Props) -> object:
        lv, rv = lf(props), rf(props)
        if (lv is None) != (rv is None):
            return None if lv is None else False
        if lv is None or _java_equals(lv, rv):
            return True
        return _compare(lv, rv) == 0

    return _node(evaluate, left, right, boolean=True, text=f"{left} = {right}")


def _equal(left: _Node, right: _Node) -> _Node:
    for node in (left, right):
        if node.constant and node.value is None:
            raise InvalidFilterError(f"{node} cannot be compared (use IS NULL)")
    if left.constant and right.constant and left.boolean and not right.boolean:
        raise InvalidFilterError(f"{left} cannot be compared with {right}")
    return _equal_unchecked(left, right)


_ORDER = {">": lambda c: c > 0, ">=": lambda c: c >= 0, "<": lambda c: c < 0, "<=": lambda c: c <= 0}


def _ordering(op: str, left: _Node, right: _Node) -> _Node:
    _check_less_than_operand(left)
    _check_less_than_operand(right)
    lf, rf, holds = left.evaluate, right.evaluate, _ORDER[op]

    def evaluate(props: Props) -> object:
        lv = lf(props)
        if lv is None:
            return None
        rv = rf(props)
        if rv is None:
            return None
        if type(lv) is str and type(rv) is str:  # two properties: as doubles, or an error
            lv, rv = _java_double(lv), _java_double(rv)
        return holds(_compare(lv, rv))

    return _node(evaluate, left, right, boolean=True, text=f"{left} {op} {right}")


def _between(value: _Node, low: _Node, high: _Node, negated: bool) -> _Node:
    if negated:
        return _logic("OR", _ordering("<", value, low), _ordering(">", value, high))
    if low.constant and high.constant:
        if low.value is None or high.value is None:
            raise InvalidFilterError("the bounds of BETWEEN cannot be NULL")
        try:
            backwards = _compare(high.value, low.value) < 0
        except _EvalError as exc:
            raise InvalidFilterError(f"bounds of BETWEEN that cannot be compared: {exc}") from None
        if backwards:
            raise InvalidFilterError(f"BETWEEN {low} AND {high}: the first bound must not be above the second")
    return _logic("AND", _ordering(">=", value, low), _ordering("<=", value, high))


def _text_test(op: str, node: _Node, search: str, negated: bool) -> _Node:
    f = node.evaluate
    test = {"CONTAINS": str.__contains__, "STARTSWITH": str.startswith, "ENDSWITH": str.endswith}[op]

    def evaluate(props: Props) -> object:
        if not search:
            return False
        value = f(props)
        if type(value) is not str:  # NULL included: FALSE, not unknown, either way round
            return False
        return test(value, search) != negated

    return _node(evaluate, node, boolean=True, text=f"{node} {'NOT ' if negated else ''}{op} '{search}'")


def _in(node: _Node, items: list[str], negated: bool) -> _Node:
    if node.prop is None:
        raise InvalidFilterError(f"IN needs a property on its left, not {node}")
    name, members = node.prop, frozenset(items)

    def evaluate(props: Props) -> object:
        value = props.get(name)
        if type(value) is not str:
            return None
        return (value in members) != negated

    return _node(evaluate, node, boolean=True, text=f"{name} {'NOT ' if negated else ''}IN (...)")


def _negate(node: _Node) -> _Node:
    f = node.evaluate

    def evaluate(props: Props) -> object:
        value = f(props)
        kind = type(value)
        if kind in (Int, Long):
            return kind(-value)  # type: ignore[operator]
        if kind is float:
            return -value  # type: ignore[operator]
        return None

    return _node(evaluate, node, text=f"-{node}")  # not a constant to the parser's checks, as in RocketMQ


# --- the parser: RocketMQ's grammar, by recursive descent ----------------------------------------------------

_KEYWORDS = {"NOT", "AND", "OR", "BETWEEN", "IN", "TRUE", "FALSE", "NULL", "IS", "CONTAINS", "STARTSWITH",
             "ENDSWITH"}
# One alternative per first character, and none rescans what another gave up on, so tokenizing is linear: a
# "float" tried before "decimal" at each "0" of "000...0" rescanned the digits, and "--" looked to the end for a
# line end at each "-" of "---...-": 16 KB took 3 s.
_TOKEN = re.compile(r"""
    (?P<space>[ \t\n\r\f]+)
  | (?P<comment>/\*[^*]*\*+(?:[^*/][^*]*\*+)*/)
  | (?P<dashes>--)  # a comment when a line end follows, else two minus signs: decided in _tokens
  | (?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)  # a decimal or float: told apart in _tokens
  | (?P<string>'[^']*(?:''[^']*)*')
  | (?P<id>[A-Za-z_$][A-Za-z0-9_$]*)
  | (?P<op><>|>=|<=|[=><(),+-])
""", re.VERBOSE | re.ASCII)
_LINE_END = re.compile(r"[^\n\r]*(?:\r\n|\n|\r)")


def _clip(text: str) -> str:
    """A token as an error message quotes it: a 16 KB number need not be repeated to its sender whole."""
    return text if len(text) <= 40 else text[:40] + "..."


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # "keyword", "float", "decimal", "string", "id", "op", "end"
    text: str
    pos: int


def _tokens(expression: str) -> list[_Token]:
    """RocketMQ's tokens (JavaCC's longest match), in one pass."""
    out, pos = [], 0
    last_line_end = max(expression.rfind("\n"), expression.rfind("\r"))
    while pos < len(expression):
        match = _TOKEN.match(expression, pos)
        if match is None:
            raise InvalidFilterError(f"unexpected character {expression[pos]!r} at position {pos + 1}")
        kind = match.lastgroup
        text = match.group()
        end = match.end()
        if kind == "dashes":
            if last_line_end > pos + 1:  # LINE_COMMENT needs a line end: skip to the first one
                end = _LINE_END.match(expression, end).end()  # type: ignore[union-attr]
            else:
                out.append(_Token("op", "-", pos))
                end = pos + 1
        elif kind == "number":
            if not text.isdigit():
                out.append(_Token("float", text, pos))
            else:  # DECIMAL_LITERAL is "0", or 1-9, digits and an optional L: "007L" is 0, 0 and 7L
                first = pos + len(text) - len(text.lstrip("0"))
                out.extend(_Token("decimal", "0", at) for at in range(pos, first))
                if first < end:
                    if expression[end:end + 1] in ("l", "L"):
                        end += 1
                    out.append(_Token("decimal", expression[first:end], first))
        elif kind not in ("space", "comment"):
            if kind == "id" and text.upper() in _KEYWORDS:
                kind, text = "keyword", text.upper()
            out.append(_Token(kind, text, pos))  # type: ignore[arg-type]
        pos = end
    out.append(_Token("end", "", len(expression)))
    return out


class _Parser:
    def __init__(self, expression: str) -> None:
        self.tokens = _tokens(expression)
        self.i = 0
        self.nesting = 0  # parentheses open now, and the prefix operators before them

    def peek(self, ahead: int = 0) -> _Token:
        return self.tokens[min(self.i + ahead, len(self.tokens) - 1)]

    def at(self, *texts: str, ahead: int = 0) -> bool:
        token = self.peek(ahead)
        return token.kind in ("keyword", "op") and token.text in texts

    def take(self) -> _Token:
        token = self.peek()
        self.i += 1
        return token

    def expect(self, text: str) -> None:
        if not self.at(text):
            self.fail(f"expected {text!r}")
        self.take()

    def fail(self, what: str) -> None:
        token = self.peek()
        found = "the end" if token.kind == "end" else repr(_clip(token.text))
        raise InvalidFilterError(f"{what} at position {token.pos + 1}, found {found}")

    def selector(self) -> _Node:
        node = _as_boolean(self.or_expression())
        if self.peek().kind != "end":
            self.fail("unexpected text after the expression")
        return node

    # orExpression and andExpression: ``x OR y OR z`` is one node for the whole run (built once, not once per
    # operand). Written out twice, not through a shared helper: each call on the way down to a parenthesis is a
    # Python frame per nesting level (see MAX_DEPTH).

    def or_expression(self) -> _Node:
        first = self.and_expression()
        if not self.at("OR"):
            return first
        operands = [_as_boolean(first)]
        while self.at("OR"):
            self.take()
            operands.append(_as_boolean(self.and_expression()))
        return _logic("OR", *operands)

    def and_expression(self) -> _Node:
        first = self.equality()
        if not self.at("AND"):
            return first
        operands = [_as_boolean(first)]
        while self.at("AND"):
            self.take()
            operands.append(_as_boolean(self.equality()))
        return _logic("AND", *operands)

    def equality(self) -> _Node:
        left = self.comparison()
        while True:
            if self.at("="):
                self.take()
                left = _equal(left, self.comparison())
            elif self.at("<>"):
                self.take()
                left = _logic_not(_equal(left, self.comparison()))
            elif self.at("IS") and self.at("NULL", ahead=1):
                self.i += 2
                left = _equal_unchecked(left, _constant(None, "NULL"))
            elif self.at("IS"):
                self.take()
                self.expect("NOT")
                self.expect("NULL")
                left = _logic_not(_equal_unchecked(left, _constant(None, "NULL")))
            else:
                return left

    def comparison(self) -> _Node:
        left = self.unary()
        while True:
            if self.at(">", ">=", "<", "<="):
                op = self.take().text
                left = _ordering(op, left, self.unary())
                continue
            negated = self.at("NOT") and self.at("CONTAINS", "STARTSWITH", "ENDSWITH", "BETWEEN", "IN", ahead=1)
            if negated:
                self.take()
            if self.at("CONTAINS", "STARTSWITH", "ENDSWITH"):
                op = self.take().text
                left = _text_test(op, left, self.string(), negated)
            elif self.at("BETWEEN"):
                self.take()
                low = self.unary()
                self.expect("AND")
                left = _between(left, low, self.unary(), negated)
            elif self.at("IN"):
                self.take()
                self.expect("(")
                items = [self.string()]
                while self.at(","):
                    self.take()
                    items.append(self.string())
                self.expect(")")
                left = _in(left, items, negated)
            else:
                return left

    def unary(self) -> _Node:
        """unaryExpr and a parenthesis: signs and NOT are read in a loop, so only a parenthesis recurses (five
        frames: unary, or_expression, and_expression, equality, comparison)."""
        prefixes = []
        while self.at("+", "-", "NOT"):
            prefixes.append(self.take().text)
        opened = len(prefixes) + self.at("(")
        if self.nesting + opened > MAX_DEPTH:
            raise InvalidFilterError(f"the SQL92 filter is nested more than {MAX_DEPTH} deep")
        if self.at("("):
            self.nesting += opened
            self.take()
            node = self.or_expression()
            self.expect(")")
            self.nesting -= opened
        else:
            node = self.primary()
        for op in reversed(prefixes):
            if op == "-":
                node = _negate(node)
            elif op == "NOT":
                node = _logic_not(_as_boolean(node))
        return node

    def primary(self) -> _Node:
        token = self.peek()
        if token.kind == "string":
            return _constant(self.string(), token.text)
        if token.kind == "decimal":
            self.take()
            digits = token.text.rstrip("lL")
            if len(digits.lstrip("0")) > 19:  # past 64 bits whatever the digits (int() refuses 4,300 and more)
                raise InvalidFilterError(f"{token.text[:40]}... does not fit in 64 bits")
            value = int(digits)
            if value > _LONG_RANGE[1]:
                raise InvalidFilterError(f"{token.text} does not fit in 64 bits")
            return _constant(Int(value) if value <= _INT_RANGE[1] else Long(value), token.text)
        if token.kind == "float":
            self.take()
            value = float(token.text)
            if math.isinf(value) or value < _DOUBLE_MIN:
                raise InvalidFilterError(f"{_clip(token.text)}: RocketMQ accepts decimals from {_DOUBLE_MIN} to "
                                         "1.7976931348623157e308 (write 0 for zero)")
            return _constant(value, token.text)
        if token.kind == "keyword" and token.text in ("TRUE", "FALSE", "NULL"):
            self.take()
            return _constant({"TRUE": True, "FALSE": False, "NULL": None}[token.text], token.text)
        if token.kind == "id":
            self.take()
            return _property(token.text)
        self.fail("expected a value, a property or '('")
        raise AssertionError  # fail raised

    def string(self) -> str:
        token = self.peek()
        if token.kind != "string":
            self.fail("expected a quoted string")
        self.take()
        return token.text[1:-1].replace("''", "'")


@dataclass(frozen=True)
class SqlFilter:
    """A compiled SQL92 subscription: ``matches(properties)`` for each message."""

    expression: str
    _root: Evaluate

    def matches(self, properties: Props) -> bool:
        """TRUE selects; FALSE, unknown (NULL) and an evaluation failure do not (as on a broker)."""
        try:
            return self._root(properties) is True
        except _EvalError:
            return False


def select_rows(batch, selector: SqlFilter):
    """The rows of a ``pyarrow.RecordBatch`` of messages (its ``properties`` map column) that ``selector``
    selects: for tools that read queues in batches (one dict per row, tested as ``get_message`` tests a
    message)."""
    import pyarrow as pa

    keep = [selector.matches(dict(pairs or ())) for pairs in batch.column("properties").to_pylist()]
    return batch.filter(pa.array(keep, pa.bool_()))


def subscription_filter(tags: object, sql: str | SqlFilter | None) -> SqlFilter | None:
    """The SQL92 filter of a subscription, compiled; ``tags`` is the parsed tag set (None: every tag). A
    subscription filters by tags or by SQL92, never both (RocketMQ's expression type is one or the other)."""
    if sql is None:
        return None
    if tags is not None:
        raise InvalidQueryError("subscribe by tags or by an SQL92 expression, not both")
    return sql if isinstance(sql, SqlFilter) else compile_sql92(sql)


def compile_sql92(expression: str) -> SqlFilter:
    """Parse ``expression`` (compiled filters are cached, as RocketMQ caches them, and so are refusals: a client
    sending the same bad filter again is answered without parsing it again). Raises ``InvalidFilterError``
    naming what is wrong and where."""
    if not isinstance(expression, str):
        raise InvalidFilterError(f"an SQL92 filter is a string, not {type(expression).__name__}")
    compiled = _compiled(expression)
    if isinstance(compiled, str):
        raise InvalidFilterError(compiled)
    return compiled


@functools.lru_cache(maxsize=256)
def _compiled(expression: str) -> SqlFilter | str:
    """The filter, or why it is refused (an exception is not cached by lru_cache, its message is)."""
    if not expression.strip():
        return "the SQL92 filter expression is empty"
    try:
        return SqlFilter(expression, _Parser(expression).selector().evaluate)
    except InvalidFilterError as exc:
        return str(exc)
