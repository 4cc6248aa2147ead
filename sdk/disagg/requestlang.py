"""The request language: composition requests as short text, or as a TOML/JSON document.

Text, one clause list per resource, resources separated by ``;``::

    host cores>=16 memory>=256GiB; gpu x8 model=H200 gpu_memory>=80GiB latency<=600ns same-switch spread=chassis;
    cxl-memory 512GiB

A document carries the same fields by name (see ``docs/request-language.md``).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any, TypeVar

from disagg.errors import InvalidRequestError
from disagg.interfaces.fabric import MAX_ID, id_text
from disagg.model import (
    SELECTOR_KEY,
    Affinity,
    AttributeValue,
    CompositionRequest,
    DeviceKind,
    HostRequest,
    ResourceRequest,
    Selector,
    SelectorOp,
    parse_attribute_value,
    parse_latency,
    parse_size,
    selector_refusal,
    spread_refusal,
)
from disagg.model.composition import (
    MAX_BYTES,
    MAX_COUNT,
    MAX_RESOURCE_LINES,
    MAX_SELECTOR_KEY,
    MAX_SELECTORS,
    SELECTOR_INT_RANGE,
    conflict_refusal,
    host_limit_refusal,
    resource_limit_refusal,
    selector_value_refusal,
    selectors_conflict,
)
from disagg.model.units import shown

_CLAUSE = re.compile(rf"^({SELECTOR_KEY.pattern})\s*(!=|>=|<=|=|>|<)\s*(.+)$")
_OPS = {op.value: op for op in SelectorOp}
_ORDERS = frozenset(SelectorOp) - {SelectorOp.EQ, SelectorOp.NE}
_COUNT = re.compile(r"^(?:x|\*)?(\d+)$", flags=re.ASCII)
_BARE_DECIMAL = re.compile(r"\d+\.\d+", flags=re.ASCII)
"""``512.0``: a number with a point and no unit."""
T = TypeVar("T")
_CLIPPED_SIZE = re.compile(r"\d+(\.\d+)?\s*[KMGTP]i?", flags=re.IGNORECASE | re.ASCII)
"""``80G`` or ``80Gi``: a size whose B was left out."""
_OTHER_NUMBER = re.compile(
    r"[+-]?(?:0x[0-9a-f_]+|0o[0-7_]+|0b[01_]+|(?:\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(?:e[+-]?\d+)?)", flags=re.IGNORECASE
)
"""A number in a notation the language does not read (``8e10``, ``0x10``, ``1_000``, ``+5``, ``.5``): read as
text, it would compare with no number and match nothing, silently."""
_OTHER_DIGIT = re.compile(r"[+-]?(?![0-9])\d")
"""A value that begins with a digit of another script (Arabic-Indic, fullwidth): the language reads numbers in 0-9
only, so read as text it would compare with no number and match nothing, silently."""
_NOT_FINITE = re.compile(r"[+-]?(?:nan|inf|infinity)", flags=re.IGNORECASE)
"""``inf`` or ``nan``, which reads as a number in other languages: here it is text, which no number is ordered
with, so that ``gpu_memory>=inf`` matched nothing, silently."""
_OPERATOR_TYPOS = {"==": "=", "=>": ">=", "=<": "<=", "<>": "!=", "=!": "!=", "!==": "!=", ">==": ">=", "<==": "<="}
"""Operators as other languages write them, read by `_CLAUSE` as an operator and a value that starts with the
rest, and what this language writes for each."""


parse_value = parse_attribute_value
"""An attribute value as text is read (`disagg.model.parse_attribute_value`)."""


def parse_selector(text: str, field: str = "selector", *, clause: bool = False) -> Selector:
    """A selector written as ``key=value``; ``clause``: it is a word of a text clause, which was split as a shell
    splits words (taking off a layer of quotes), so that a hint to quote a value quotes it twice."""
    key, op, value = _selector_parts(text, field, clause=clause)
    if isinstance(value, str) and _OTHER_NUMBER.fullmatch(value) and text.strip().endswith(value):  # not quoted
        raise InvalidRequestError(_other_number(text, key, op.value, value, clause=clause), field=field)
    if isinstance(value, str) and _OTHER_DIGIT.match(value) and text.strip().endswith(value):  # not quoted
        raise InvalidRequestError(
            f"{shown(text)}: {shown(value)} begins with a digit other than 0-9, which the request language does not "
            f"read as a number (write it in 0-9); to compare with the text {shown(value)}, quote it: "
            f"{_quoted(key, op.value, value, clause=clause)}",
            field=field,
        )
    if isinstance(value, str) and op in _ORDERS and _NOT_FINITE.fullmatch(value) and text.strip().endswith(value):
        raise InvalidRequestError(
            f"{shown(text)}: {shown(value)} is not a number a device can have (a selector orders finite numbers); "
            f"to compare with the text {shown(value)}, quote it: {_quoted(key, op.value, value, clause=clause)}",
            field=field,
        )
    why = selector_value_refusal(value)
    if why:
        raise InvalidRequestError(f"{shown(text)}: {why}", field=field)
    selector = Selector(key, op, value)
    if isinstance(value, str) and op in _ORDERS and _CLIPPED_SIZE.fullmatch(value):
        # As text it would be compared with the attribute's bytes and match nothing, silently.
        unit = f"{value}B" if value[-1] in "iI" else f"{value}B or {value}iB"
        raise InvalidRequestError(f"{shown(text)}: a size needs its unit in full, {unit}", field=field)
    return selector


def _selector_parts(
    text: str, field: str, *, clause: bool, host: bool = False
) -> tuple[str, SelectorOp, AttributeValue]:
    """A selector's key, operator and value, the value not yet held to a selector's range: a host's ``cores``
    and ``memory`` minimums (``host``: the clause is a host's) have their own."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{shown(text)} is not a selector: write it as text, key=value", field=field)
    match = _CLAUSE.match(text.strip())
    if not match:
        raise InvalidRequestError(f"{shown(text)} is not a selector (write key=value, key>=value, ...)", field=field)
    key, op, value = match.groups()
    if len(key) > MAX_SELECTOR_KEY:
        raise InvalidRequestError(
            f"{key[:16]}...: a selector's key is at most {MAX_SELECTOR_KEY} characters, not {len(key)}", field=field
        )
    if value[0] in "=<>!":
        # ``model==H200`` would compare with the text "=H200" and match nothing, silently.
        raise InvalidRequestError(_operator_typo(text, key, op, value, clause=clause), field=field)
    why = _digits_refusal(value, key if host and key in ("cores", "memory") else "")
    if why:
        raise InvalidRequestError(f"{shown(text)}: {why}", field=field)
    try:
        parsed = parse_value(value)
    except ValueError as exc:
        raise InvalidRequestError(f"{shown(text)}: {exc}", field=field) from exc
    return key, _OPS[op], parsed


def _other_number(text: str, key: str, op: str, value: str, *, clause: bool) -> str:
    """Why ``8e10`` is refused, with the number it means written as the language reads numbers (when it is one
    of reasonable length), and how to compare with it as text instead: quoted."""
    written = _quoted(key, op, value, clause=clause)
    plain = value.replace("_", "")
    meant = ""
    try:
        meant = str(int(plain, 0))
    except ValueError:
        try:
            number = Decimal(plain)
        except InvalidOperation:
            pass
        else:
            if number.is_finite() and abs(number.adjusted()) <= 30:
                meant = format(number.normalize() if number == number.to_integral() else number, "f")
    hint = f"write {key}{op}{meant}" if meant and len(meant) <= 40 else "write it in digits, e.g. 1.5 or 80000000000"
    return (
        f"{shown(text)}: {shown(value)} is not a number the request language reads ({hint}, or a size such as 80GB); "
        f"to compare with the text {shown(value)}, quote it: {written}"
    )


def _quoted(key: str, op: str, value: str, *, clause: bool) -> str:
    """The selector that compares ``key`` with the text ``value``: quoted, and in a text clause, whose own quotes
    come off as it is split into words, quoted again."""
    quoted = f'"{value[:64]}..."' if len(value) > 64 else f'"{value}"'
    return f"{key}{op}{shlex.quote(quoted) if clause else quoted}"


def _operator_typo(text: str, key: str, op: str, value: str, *, clause: bool) -> str:
    """Why a value that starts with an operator's character is refused, with the selector likely meant, and how
    to compare with such a value (``label=<none>``): quoted, ``label="<none>"``. In a text clause the quotes are
    quoted in turn, since the clause's own come off as it is split into words: ``label='"<none>"'``."""
    rest = value.lstrip("=<>!")
    typed = op + value[: len(value) - len(rest)]
    meant = _OPERATOR_TYPOS.get(typed)
    hint = f"write {key}{meant}{rest[:64]}" if meant else "the operators are =, !=, >=, <=, > and <"
    value = value if len(value) <= 64 else f"{value[:64]}..."
    quoted = f"'{value}'" if '"' in value else f'"{value}"'
    written = f"{key}{op}{shlex.quote(quoted)}" if clause else f"{key}{op}{quoted}"
    return (
        f"{shown(text)}: {typed!r} is not an operator ({hint}; to compare with the text {shown(value)}, quote it: "
        f"{written})"
    )


def _tokens(text: str, field: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise InvalidRequestError(f"cannot read {shown(text)}: {exc}", field=field) from exc


def parse_host(text: str, field: str = "host") -> HostRequest:
    """``host h3``, ``host cores>=16 memory>=256GiB rack=r1`` or both (``host h3 cores>=16``); the leading word ``host``
    is optional."""
    tokens = _tokens(text, field)
    if tokens and tokens[0] == "host":
        tokens = tokens[1:]
    name: str | None = None
    if tokens and not _CLAUSE.match(tokens[0]):  # only the first word may name the host: later, it is a typo
        name, tokens = tokens[0], tokens[1:]
    if name is not None:
        _check_host_name(name, field)
    cores = memory = 0
    selectors: list[Selector] = []
    written: list[str] = []
    seen: set[str] = set()
    for tok in tokens:
        key, op, value = _selector_parts(tok, field, clause=True, host=True)
        if key not in ("cores", "memory"):
            selectors.append(parse_selector(tok, field, clause=True))
            written.append(tok)
            continue
        if op is not SelectorOp.GE:
            raise InvalidRequestError(f"{shown(tok)}: write {key}>=VALUE for a host minimum", field=field)
        _once(key, seen, tok, field)
        if key == "memory":
            memory = _size(value, tok, field)
        elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidRequestError(f"{shown(tok)}: cores must be a whole number", field=field)
        else:
            cores = value
    _check_conflicts(selectors, written, lambda n: field)
    return _host(name, cores, memory, tuple(selectors), field)


def _check_host_name(name: str, field: str) -> None:
    """Refuse a host name that is no host's id (`disagg.interfaces.check_id`: 1 to `MAX_ID` printable characters
    without spaces), as a server refuses it: the local composer answered that no fabric has such a host."""
    if not 0 < len(name) <= MAX_ID or not id_text(name):
        raise InvalidRequestError(
            f"{shown(name)}: a host name is 1 to {MAX_ID} printable characters without spaces, as drivers name "
            "hosts (disagg topology lists them)",
            field=field,
        )


def _host(name: str | None, cores: int, memory: int, selectors: tuple[Selector, ...], field: str) -> HostRequest:
    """The host request, a minimum the wire cannot carry refused as the request's mistake."""
    host = HostRequest(name=name, min_cores=cores, min_memory_bytes=memory, selectors=selectors)
    refusal = host_limit_refusal(host)
    if refusal is not None:
        raise InvalidRequestError(refusal[1], field=field)
    return host


def _once(modifier: str, seen: set[str], token: str, field: str) -> None:
    """Refuse a modifier given twice in one clause (``spread=chassis spread=rack``): the last would silently win."""
    if modifier in seen:
        raise InvalidRequestError(f"{shown(token)}: {modifier} is given twice in one clause; give it once", field=field)
    seen.add(modifier)


def _size(value: AttributeValue, token: str, field: str) -> int:
    """A host's least memory; ``memory>=0`` is no minimum, as ``cores>=0`` and a document's ``min_memory = 0``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(f"{shown(token)} is not a size (write e.g. 512GiB)", field=field)
    return value


def parse_resource(text: str, field: str = "resource") -> ResourceRequest:
    """``gpu x8 model=H200 latency<=600ns same-switch spread=chassis`` or ``cxl-memory 512GiB``."""
    tokens = _tokens(text, field)
    if not tokens:
        raise InvalidRequestError("an empty resource", field=field)
    try:
        kind = DeviceKind.parse(tokens[0])
    except ValueError as exc:
        raise InvalidRequestError(str(exc), field=field) from exc
    count: int | None = None
    amount: int | None = None
    latency: int | None = None
    affinity = Affinity.NONE
    spread: str | None = None
    selectors: list[Selector] = []
    written: list[str] = []
    seen: set[str] = set()
    for tok in tokens[1:]:
        count_match = _COUNT.match(tok)
        if count_match and count is None and amount is None:
            count = _count(count_match.group(1), field)
            if count == 0:
                raise InvalidRequestError(f"{shown(tok)}: a count must be at least 1", field=field)
        elif tok in ("same-switch", "affinity=same-switch"):
            _once("same-switch", seen, tok, field)
            affinity = Affinity.SAME_SWITCH
        elif tok.startswith("spread="):
            _once("spread", seen, tok, field)
            spread = tok.split("=", 1)[1]
            if not spread:
                raise InvalidRequestError("spread= needs a failure-domain label", field=field)
            _check_spread(spread, field)
        elif tok.startswith(("latency<=", "latency<")):
            _once("latency", seen, tok, field)
            strict = not tok.startswith("latency<=")
            try:
                latency = parse_latency(tok.split("<", 1)[1].lstrip("=")) - strict
            except ValueError as exc:
                raise InvalidRequestError(str(exc), field=field) from exc
            if latency < 0:
                raise InvalidRequestError(f"{shown(tok)}: no latency is below zero", field=field)
        elif count is None and amount is None and not _CLAUSE.match(tok):
            why = bare_amount_refusal(tok)
            if why:
                raise InvalidRequestError(why, field=field)
            why = _amount_refusal(tok)
            if why:
                raise InvalidRequestError(f"{shown(tok)}: {why}", field=field)
            try:
                amount = parse_size(tok)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"{shown(tok)} is neither a count (x8) nor an amount (512GiB)", field=field
                ) from exc
            if amount == 0:
                raise InvalidRequestError(f"{shown(tok)}: an amount must be more than zero", field=field)
        else:
            selectors.append(_selector(tok, field, clause=True))
            written.append(tok)
    if count is None and amount is None:
        count = 1
    _check_conflicts(selectors, written, lambda n: field)
    return _build(
        kind,
        count=count or 0,
        amount=amount or 0,
        selectors=tuple(selectors),
        latency=latency,
        affinity=affinity,
        spread=spread,
        field=field,
    )


_AMOUNT = re.compile(r"\s*0*(\d*)(?:\.\d+)?\s*[a-z]*\s*", flags=re.IGNORECASE | re.ASCII)


def _amount_refusal(text: object, what: str = "an amount") -> str:
    """Why ``text`` is an amount (or ``what`` else of bytes) too large for the wire to carry, when its number has
    more digits than the most (`MAX_BYTES`) has; else empty. Past 4300 digits `parse_size` cannot read it, and
    the text form answered that it was no amount at all."""
    match = _AMOUNT.fullmatch(text) if isinstance(text, str) else None
    if match is None or len(match.group(1)) <= len(str(MAX_BYTES)):
        return ""
    return f"{what} of {len(match.group(1)):,} digits is more than the most a request may give, {MAX_BYTES} bytes"


def _amount(text: Any, what: str = "an amount") -> int:
    """`parse_size`, an amount of more digits than the wire carries refused as too large (`_amount_refusal`)."""
    why = _amount_refusal(text, what)
    if why:
        raise ValueError(why)
    return parse_size(text)


_WHOLE = re.compile(r"-?0*(\d+)|0*(\d+)(?:\.\d+)?\s*[KMGTP]i?B", flags=re.IGNORECASE | re.ASCII)
"""A value `parse_value` reads as a whole number: digits, or a size with its unit (in bytes)."""


def _digits_refusal(value: str, minimum: str) -> str:
    """Why ``value`` is refused, when it is a whole number of more digits than the most it may be has (a host's
    ``cores`` or ``memory``, named by ``minimum``; else a selector's int64), naming that most; else empty. Past
    4300 digits `int` cannot read it, and the refusal said only that it was long, as no amount's does."""
    if minimum == "memory":
        return _amount_refusal(value, "a minimum of memory")
    match = _WHOLE.fullmatch(value.strip())
    if match is None:
        return ""
    digits = len(match.group(1) or match.group(2))
    if minimum == "cores" and match.group(1) and digits > len(str(MAX_COUNT)):
        return f"a minimum of cores of {digits:,} digits is more than the most a request may give, {MAX_COUNT}"
    if minimum or digits <= len(str(SELECTOR_INT_RANGE.stop)):
        return ""
    return (
        f"{'a size' if match.group(2) else 'a number'} of {digits:,} digits is beyond the whole numbers a selector "
        f"compares with, {SELECTOR_INT_RANGE.start} to {SELECTOR_INT_RANGE.stop - 1}"
    )


def _count(digits: str, field: str) -> int:
    """A count written in ``digits``, refused past `MAX_COUNT` before `int` reads it: past 4300 digits `int`
    raises a ValueError of its own, which escaped."""
    digits = digits.lstrip("0") or "0"
    if len(digits) > len(str(MAX_COUNT)):
        raise InvalidRequestError(
            f"a count of {len(digits)} digits is more than the most a request may give, {MAX_COUNT}", field=field
        )
    return int(digits)


def bare_amount_refusal(text: str) -> str:
    """Why ``text`` is no amount of memory, when it is a number with a point and no unit (``512.0``); else empty.
    A whole number alone is a count of devices (``cxl-memory 512``), so ``512.0`` read as 512 bytes silently
    meant something else."""
    if not _BARE_DECIMAL.fullmatch(text.strip()):
        return ""
    number = text.strip().rstrip("0").rstrip(".")
    return (
        f"{shown(text)} has no unit: {number[:64]}GiB? (an amount of memory is written with its unit; a whole number "
        "alone is a count of devices)"
    )


def _check_spread(label: str, field: str) -> None:
    """Refuse a ``spread`` label the protocol refuses (`spread_refusal`): locally it found no fit."""
    refusal = spread_refusal(label)
    if refusal is not None:
        raise InvalidRequestError(f"spread={refusal}", field=field)


def _selector(text: str, field: str, *, clause: bool = False) -> Selector:
    """A device selector of a resource line, refusing a mistyped modifier (``latency>=100ns``) or a key that
    names one device (``serial=...``)."""
    selector = parse_selector(text, field, clause=clause)
    refusal = selector_refusal(selector.key, resource=True)
    if refusal:
        raise InvalidRequestError(f"{shown(text)}: {refusal}", field=field)
    return selector


def _build(
    kind: DeviceKind,
    *,
    count: int,
    amount: int,
    selectors: tuple[Selector, ...],
    latency: int | None,
    affinity: Affinity,
    spread: str | None,
    field: str,
) -> ResourceRequest:
    try:
        line = ResourceRequest(
            kind=kind,
            count=count,
            amount_bytes=amount,
            selectors=selectors,
            max_latency_ns=latency,
            affinity=affinity,
            spread=spread,
        )
    except ValueError as exc:
        raise InvalidRequestError(str(exc), field=field) from exc
    refusal = resource_limit_refusal(line)  # a number the wire cannot carry, refused here as by a server
    if refusal is not None:
        raise InvalidRequestError(refusal[1], field=field)
    return line


def parse_request(name: str, clauses: Sequence[str]) -> CompositionRequest:
    """A request from text clauses; a clause starting with ``host`` names or constrains the host."""
    host: HostRequest | None = None
    resources: list[ResourceRequest] = []
    parts = [p.strip() for clause in clauses for p in clause.split(";") if p.strip()]
    for n, part in enumerate(parts):
        field = f"clauses[{n}]"
        if part.split()[0] == "host":
            if host is not None:
                raise InvalidRequestError(f"{shown(part)}: a request has one host clause", field=field)
            host = parse_host(part, field=field)
        else:
            resources.append(parse_resource(part, field=field))
    return _request(name, resources, host or HostRequest())


def _request(name: str, resources: Sequence[ResourceRequest], host: HostRequest) -> CompositionRequest:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", name or ""):
        raise InvalidRequestError(
            f"invalid composition name {shown(name)}: 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            field="name",
        )
    if not resources:
        raise InvalidRequestError("a composition needs at least one resource", field="resources")
    if len(resources) > MAX_RESOURCE_LINES:  # as a server refuses it
        raise InvalidRequestError(
            f"a composition has at most {MAX_RESOURCE_LINES} resource lines, not {len(resources)}: give a line a "
            "count (gpu x8) rather than repeating it",
            field="resources",
        )
    return CompositionRequest(name=name, resources=tuple(resources), host=host)


def request_from_document(doc: Any) -> CompositionRequest:
    """A request from a parsed TOML or JSON document (``name``, ``[host]``, ``[[resource]]``)."""
    if not isinstance(doc, Mapping):
        raise InvalidRequestError("a request document is a table of name, host and resource", field="request")
    _check_keys(doc, "request")
    unknown = set(doc) - {"name", "host", "resource", "resources"}
    if unknown:
        raise InvalidRequestError(f"unknown request fields: {', '.join(sorted(unknown))}", field=sorted(unknown)[0])
    name = doc.get("name", "")
    if not isinstance(name, str):
        raise InvalidRequestError(f"name must be text, not {shown(name)}", field="name")
    host_doc = doc.get("host", {})
    if isinstance(host_doc, str):
        host = parse_host(host_doc)
    elif isinstance(host_doc, Mapping):
        host = _host_from_document(host_doc)
    else:
        raise InvalidRequestError("host must be a name or a table", field="host")
    if "resource" in doc and "resources" in doc:
        raise InvalidRequestError("give resource or resources (the same field), not both", field="resources")
    items = doc.get("resource", doc.get("resources", []))
    if not isinstance(items, list):
        raise InvalidRequestError("resource must be a list of tables", field="resource")
    resources = [_resource_from_document(item, f"resource[{n}]") for n, item in enumerate(items)]
    return _request(name, resources, host)


def _check_keys(doc: Mapping[Any, Any], field: str) -> None:
    """Refuse a key that is not text, which only a table built in Python has: sorting the unknown fields raised
    TypeError."""
    for key in doc:
        if not isinstance(key, str):
            raise InvalidRequestError(
                f"{shown(key)} is not a field name: a field of {field} is named by text", field=field
            )


def _selectors_from_document(items: Any, field: str, *, resource: bool) -> tuple[Selector, ...]:
    if not isinstance(items, list):
        raise InvalidRequestError(f'{field} must be a list of selectors, e.g. ["model=H200"]', field=field)
    parse = _selector if resource else parse_selector
    selectors = [parse(s, f"{field}[{n}]") for n, s in enumerate(items)]
    _check_conflicts(selectors, items, lambda n: f"{field}[{n}]")
    return tuple(selectors)


def _check_conflicts(selectors: Sequence[Selector], written: Sequence[str], field: Callable[[int], str]) -> None:
    """Refuse selectors that no value meets together (`selectors_conflict`), named as the user wrote them;
    ``field`` names the field of the last of them by its index."""
    conflict = selectors_conflict(selectors) if len(selectors) <= MAX_SELECTORS else None
    if conflict is not None:
        chosen, why = conflict
        raise InvalidRequestError(conflict_refusal([written[m] for m in chosen], why), field=field(chosen[-1]))


def _host_from_document(doc: Mapping[str, Any]) -> HostRequest:
    _check_keys(doc, "host")
    unknown = set(doc) - {"name", "min_cores", "min_memory", "selectors"}
    if unknown:
        raise InvalidRequestError(f"unknown host fields: {', '.join(sorted(unknown))}", field="host")
    try:
        memory = _amount(doc.get("min_memory", 0), "a minimum of memory")
    except ValueError as exc:
        raise InvalidRequestError(str(exc), field="host.min_memory") from exc
    cores = doc.get("min_cores", 0)
    if not isinstance(cores, int) or isinstance(cores, bool) or cores < 0:
        raise InvalidRequestError("min_cores must be a whole number", field="host.min_cores")
    name = doc.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise InvalidRequestError(f"host.name must name a host, not {shown(name)}", field="host.name")
    if name is not None:
        _check_host_name(name, "host.name")
    selectors = _selectors_from_document(doc.get("selectors", []), "host.selectors", resource=False)
    for n, sel in enumerate(selectors):
        if sel.key in ("cores", "memory"):
            raise InvalidRequestError(
                f"{sel}: a host minimum is min_{sel.key} in a document, not a selector", field=f"host.selectors[{n}]"
            )
    return _host(name, cores, memory, selectors, "host")


def _resource_from_document(doc: Any, field: str) -> ResourceRequest:
    if not isinstance(doc, Mapping):
        raise InvalidRequestError("each resource must be a table", field=field)
    _check_keys(doc, field)
    unknown = set(doc) - {"kind", "count", "amount", "selectors", "max_latency", "affinity", "spread"}
    if unknown:
        raise InvalidRequestError(f"unknown resource fields: {', '.join(sorted(unknown))}", field=field)
    kind = _parsed(DeviceKind.parse, str(doc.get("kind", "")), f"{field}.kind")
    amount = _parsed(_amount, doc.get("amount", 0), f"{field}.amount")
    latency = (
        None if doc.get("max_latency") is None else _parsed(parse_latency, doc["max_latency"], f"{field}.max_latency")
    )
    affinity = _parsed(_affinity, doc.get("affinity", "none"), f"{field}.affinity")
    count = doc.get("count", 0 if "amount" in doc else 1)  # as in text, a line without either is one device
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise InvalidRequestError("count must be a whole number", field=f"{field}.count")
    spread = doc.get("spread")
    if spread is not None and (not isinstance(spread, str) or not spread):
        raise InvalidRequestError("spread needs a failure-domain label", field=f"{field}.spread")
    if spread is not None:
        _check_spread(spread, f"{field}.spread")
    selectors = _selectors_from_document(doc.get("selectors", []), f"{field}.selectors", resource=True)
    return _build(
        kind,
        count=count,
        amount=amount,
        selectors=selectors,
        latency=latency,
        affinity=affinity,
        spread=spread,
        field=field,
    )


def _affinity(value: Any) -> Affinity:
    """The affinity ``value`` names; the enum's own refusal quoted it whole."""
    try:
        return Affinity(value)
    except ValueError:
        raise ValueError(f"{shown(value)} is not a valid Affinity (none or same-switch)") from None


def _parsed(parse: Callable[[Any], T], value: Any, field: str) -> T:
    """``parse(value)``, its ValueError an `InvalidRequestError` naming ``field``."""
    try:
        return parse(value)
    except ValueError as exc:
        raise InvalidRequestError(f"{field}: {exc}", field=field) from exc
