"""Request ids: the digest that tells a retry from another request, and the first answer as a ledger record.

A request id is answered once: a retry with the same request gets the first answer, also after a restart,
because the answer is written to the ledger (`RequestRecord`). The request itself is kept only as a digest
of its canonical JSON, which is all a retry needs to be compared with.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from disagg import canonical, codec, errors
from disagg.errors import DisaggError
from disagg.interfaces import ComposeResult
from disagg.model import Composition

Answer = ComposeResult | Composition | DisaggError


def digest(request: object) -> str:
    """The sha256 of the request's canonical JSON (`codec.dumps`), which the ledger keeps and a retry after an
    upgrade is compared by, so it never changes. `canonical.text` writes that text without cattrs: a durable
    Compose with a request id digests its request on the event loop. What it cannot write, `codec.dumps` does."""
    try:
        text = canonical.text(request)
    except TypeError:
        text = codec.dumps(request)
    return hashlib.sha256(text.encode()).hexdigest()


def _known_class(error: DisaggError) -> type[DisaggError]:
    """The class of ``error``, or the nearest of its bases that `disagg.errors` defines: a driver's own error class
    (cxl-switch's `CommandFailedError`) is written as that base, and a retry after a restart gets the base's reason
    and status, since no other module's classes are known when the answer is read back."""
    ours = {name: value for name, value in vars(errors).items() if isinstance(value, type)}
    return next((cls for cls in type(error).__mro__ if ours.get(cls.__name__) is cls), DisaggError)


def encode(answer: Answer) -> str:
    """A first answer as a ledger document: a compose result, a composition, or the error a retry gets (with
    what its class holds besides the message: the field of an invalid request, the resource of a missing one)."""
    if not isinstance(answer, DisaggError):
        # Its record (`codec.record`, orjson, or the standard encoder for an infinite float), read back by
        # `json.loads` as any other document.
        key = "compose" if isinstance(answer, ComposeResult) else "composition"
        return f'{{"{key}":{codec.record(answer)}}}'
    doc: dict[str, Any] = {
        "error": _known_class(answer).__name__,
        "message": answer.message,
        "metadata": dict(answer.metadata),
        "field": getattr(answer, "field", ""),
    }
    if isinstance(answer, errors.NotFoundError):
        doc["resource"] = [answer.resource_type, answer.name]
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
    if isinstance(error, errors.InvalidRequestError):  # an answer an earlier release wrote may lack what follows
        error.field = str(doc.get("field") or "")
    if isinstance(error, errors.NotFoundError):
        resource_type, name = doc.get("resource") or ("", "")
        error.resource_type, error.name = str(resource_type), str(name)
    return error
