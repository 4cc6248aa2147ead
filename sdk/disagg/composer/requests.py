"""Request ids: the digest that tells a retry from another request, and the first answer as a ledger record.

A request id is answered once: a retry with the same request gets the first answer, also after a restart,
because the answer is written to the ledger (`RequestRecord`). The request itself is kept only as a digest
of its canonical JSON, which is all a retry needs to be compared with.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from disagg import codec, errors
from disagg.errors import DisaggError
from disagg.interfaces import ComposeResult
from disagg.model import Composition

Answer = ComposeResult | Composition | DisaggError


def digest(request: object) -> str:
    """The sha256 of the request's canonical JSON."""
    return hashlib.sha256(codec.dumps(request).encode()).hexdigest()


def encode(answer: Answer) -> str:
    """A first answer as a ledger document: a compose result, a composition, or the error a retry gets."""
    doc: dict[str, Any]
    if isinstance(answer, DisaggError):
        doc = {
            "error": type(answer).__name__,
            "message": answer.message,
            "metadata": dict(answer.metadata),
            "field": getattr(answer, "field", ""),
        }
    elif isinstance(answer, ComposeResult):
        doc = {"compose": codec.to_data(answer)}
    else:
        doc = {"composition": codec.to_data(answer)}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def decode(text: str) -> Answer:
    """A first answer from its ledger document. Raises one of `disagg.store.base.UNDECODABLE` for a document
    that is not one (a damaged record)."""
    doc = json.loads(text)
    if "compose" in doc:
        return codec.from_data(doc["compose"], ComposeResult)
    if "composition" in doc:
        return codec.from_data(doc["composition"], Composition)
    cls = getattr(errors, str(doc["error"]), DisaggError)
    if not (isinstance(cls, type) and issubclass(cls, DisaggError)):
        cls = DisaggError
    error = cls.__new__(cls)
    DisaggError.__init__(error, str(doc["message"]), metadata=doc.get("metadata") or {})
    if doc.get("field"):
        error.field = str(doc["field"])  # type: ignore[attr-defined]
    return error
