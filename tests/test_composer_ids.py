"""The ids the composer makes (`disagg.composer.ids`): the protocol's shape, neighbours one after another, unique
across threads and runs, and never one that a record the composer holds has."""

from __future__ import annotations

import random
import re
import threading

import pytest
from composer_helpers import composer
from disagg.composer import ids
from disagg.composer.ids import IdMaker
from disagg.model import ComposeMode, id_name_refusal
from disagg.requestlang import parse_request

SHAPE = re.compile(r"[cr]-[0-9a-f]{12}")
REQUEST = parse_request("job", ["host cores>=8", "gpu x1 model=H200"])


def _value(made: str) -> int:
    return int(made.split("-", 1)[1], 16)


class TestIdMaker:
    def test_the_protocol_s_shape(self) -> None:
        maker = IdMaker()
        made = [maker(prefix) for prefix in ("c", "r") * 50]
        assert all(SHAPE.fullmatch(m) for m in made), made
        assert all(id_name_refusal(m) for m in made), "a name of an id's shape is refused: the id must have it"

    def test_one_after_another_they_are_neighbours(self) -> None:
        maker = IdMaker()
        values = [_value(maker("c")) for _ in range(1000)]
        assert values == list(range(values[0], values[0] + 1000))

    def test_a_run_ends_and_the_next_starts_elsewhere(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(ids, "RUN_BITS", 4)
        maker = IdMaker(random.Random(7))
        values = [_value(maker("c")) for _ in range(200)]
        runs = {v >> 4 for v in values}
        assert len(values) == len(set(values))
        assert len(runs) > 10, "every 16 ids at most, a run of other upper bits"
        assert all(v & 0xF < 16 for v in values)

    def test_two_makers_start_apart(self) -> None:
        first, second = IdMaker(), IdMaker()
        assert _value(first("c")) >> ids.RUN_BITS != _value(second("c")) >> ids.RUN_BITS

    def test_threads_get_ids_of_their_own(self) -> None:
        maker = IdMaker()
        made: list[list[str]] = [[] for _ in range(8)]

        def make(into: list[str]) -> None:
            into.extend(maker("c") for _ in range(2000))

        threads = [threading.Thread(target=make, args=(into,)) for into in made]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        every = [m for into in made for m in into]
        assert len(set(every)) == len(every) == 16000


class TestTheComposersIds:
    def test_an_id_in_use_is_never_given_again(self) -> None:
        """An id maker that gives an id already in use (another run that met this one's bits): the new
        composition or reservation gets the next id, and the record already held stays as it was."""
        given = {
            "c": iter(["c-00000000000a", "c-00000000000a", "c-00000000000b"]),
            "r": iter(["r-00000000000a", "r-00000000000a", "r-00000000000b"]),
        }
        comp = composer(new_id=lambda prefix: next(given[prefix]))
        try:
            made = [comp.compose(parse_request(n, ["host cores>=8", "gpu x1 model=H200"])).composition for n in "ab"]
            held = [
                comp.compose(parse_request(n, ["host cores>=8", "gpu x1 model=H200"]), ComposeMode.RESERVE).reservation
                for n in "cd"
            ]
            assert [m.id for m in made if m is not None] == ["c-00000000000a", "c-00000000000b"]
            assert [h.id for h in held if h is not None] == ["r-00000000000a", "r-00000000000b"]
            assert {c.id: c.name for c in comp.compositions()} == {"c-00000000000a": "a", "c-00000000000b": "b"}
            assert {r.id: r.request.name for r in comp.reservations()} == {"r-00000000000a": "c", "r-00000000000b": "d"}
        finally:
            comp.close()

    def test_a_maker_that_only_repeats_itself_is_an_error_not_a_hang(self) -> None:
        comp = composer(new_id=lambda prefix: f"{prefix}-000000000001")
        try:
            comp.compose(REQUEST)
            with pytest.raises(RuntimeError, match="100 ids in a row that are in use"):
                comp.compose(parse_request("job2", ["host cores>=8", "gpu x1 model=H200"]))
            assert [c.name for c in comp.compositions()] == ["job"]
        finally:
            comp.close()
