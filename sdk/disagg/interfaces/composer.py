"""The `Composer` interface: requests in, composed systems out, across one or more fabrics."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import attrs

from disagg.model import ComposeMode, Composition, CompositionRequest, Plan, Reservation, ResourceRequest
from disagg.model._quick import quick_init


@quick_init
@attrs.frozen
class ComposeResult:
    """What `Composer.compose` answers: the plan always; a reservation for RESERVE; a composition for APPLY."""

    mode: ComposeMode
    plan: Plan
    composition: Composition | None = None
    reservation: Reservation | None = None


class Composer(abc.ABC):
    """Composes, recomposes and decomposes systems. Every method is thread-safe.

    Errors: `InvalidRequestError` for a malformed request, `NoFitError` when placement cannot meet it,
    `NotFoundError` for an unknown composition or reservation, `ConflictError` for a stale etag, and the
    driver's own errors when execution fails after a complete rollback.
    """

    @abc.abstractmethod
    def compose(
        self,
        request: CompositionRequest,
        mode: ComposeMode = ComposeMode.APPLY,
        *,
        reservation_ttl_s: float = 60.0,
    ) -> ComposeResult:
        """PREVIEW changes nothing; RESERVE holds the plan for ``reservation_ttl_s``; APPLY binds it all or nothing."""

    @abc.abstractmethod
    def apply_reservation(self, reservation_id: str) -> Composition:
        """Bind a reserved plan. Raises `NotFoundError` when it expired or never existed."""

    @abc.abstractmethod
    def release_reservation(self, reservation_id: str) -> None:
        """Give a reservation's devices back. Idempotent."""

    @abc.abstractmethod
    def recompose(
        self,
        composition_id: str,
        *,
        add: Sequence[ResourceRequest] = (),
        remove: Sequence[str] = (),
        expected_etag: str | None = None,
    ) -> Composition:
        """Add resources to or remove devices and allocations (by id) from a live composition."""

    @abc.abstractmethod
    def decompose(self, composition_id: str) -> None:
        """Unbind and release everything of a composition. Idempotent: an unknown id is not an error."""

    @abc.abstractmethod
    def get(self, composition_id: str) -> Composition: ...

    @abc.abstractmethod
    def compositions(self) -> Sequence[Composition]: ...
