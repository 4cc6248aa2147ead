"""Unit tests of the request language (`disagg.requestlang`), as described in docs/request-language.md."""

from __future__ import annotations

import json
import re
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

import attrs
import pytest
from disagg.errors import InvalidRequestError
from disagg.model import (
    Affinity,
    CompositionRequest,
    DeviceKind,
    Host,
    HostRequest,
    ResourceRequest,
    Selector,
    SelectorOp,
    textcase,
)
from disagg.model.composition import (
    MAX_SELECTOR_TEXT,
    request_limit_refusal,
    selector_value_refusal,
    selectors_conflict,
)
from disagg.requestlang import (
    parse_host,
    parse_request,
    parse_resource,
    parse_selector,
    parse_value,
    request_from_document,
)
from hypothesis import given, settings
from hypothesis import strategies as st

KiB, MiB, GiB, TiB = (1 << 10), (1 << 20), (1 << 30), (1 << 40)
DOCS = Path(__file__).resolve().parent.parent / "docs" / "request-language.md"


class TestParseValue:
    """parse_value reads booleans, integers, decimals and sizes (as bytes); anything else stays a string."""

    @pytest.mark.parametrize(
        ("text", "value"),
        [
            ("true", True),
            ("TRUE", True),
            ("false", False),
            ("42", 42),
            ("-3", -3),
            ("0", 0),
            ("1.5", 1.5),
            ("-2.25", -2.25),
            ("80GiB", 80 * GiB),
            ("80gib", 80 * GiB),
            ("80 GiB", 80 * GiB),
            ("1.5TiB", 3 * TiB // 2),
            ("500GB", 500 * 10**9),
            ("4KiB", 4 * KiB),
            ("H200", "H200"),
            ("hopper-sxm", "hopper-sxm"),
            ('"42"', "42"),
            ("'true'", "true"),
            ('"H 200"', "H 200"),
            ("  r1  ", "r1"),
        ],
    )
    def test_values(self, text: str, value: object) -> None:
        parsed = parse_value(text)
        assert parsed == value
        assert type(parsed) is type(value)


class TestParseSelector:
    """parse_selector reads key, operator and value, and refuses text that is not a selector."""

    @pytest.mark.parametrize("op", list(SelectorOp))
    def test_every_operator(self, op: SelectorOp) -> None:
        assert parse_selector(f"gpu_memory{op.value}80GiB") == Selector("gpu_memory", op, 80 * GiB)

    def test_spaces_around_operator(self) -> None:
        assert parse_selector("model = H200") == Selector("model", SelectorOp.EQ, "H200")

    @pytest.mark.parametrize(
        ("text", "meant"),
        [
            ("model==H200", "model=H200"),
            ("gpu_memory=>80GiB", "gpu_memory>=80GiB"),
            ("gpu_memory=<80GiB", "gpu_memory<=80GiB"),
            ("model<>H200", "model!=H200"),
            ("model!==H200", "model!=H200"),
        ],
    )
    def test_an_operator_from_another_language_is_refused(self, text: str, meant: str) -> None:
        """Read as an operator and a value starting with the rest, it compared with text no device has: a request
        that could not fit, where the docs promise a refused one."""
        with pytest.raises(InvalidRequestError, match=f"is not an operator \\(write {meant};") as info:
            parse_selector(text, field="clauses[0]")
        assert info.value.field == "clauses[0]"

    @pytest.mark.parametrize("text", ["k>>3", "k=!=3", "k<<3"])
    def test_any_operator_character_starting_a_value_is_refused(self, text: str) -> None:
        with pytest.raises(InvalidRequestError, match="is not an operator"):
            parse_selector(text)

    @pytest.mark.parametrize(("text", "value"), [('model="=H200"', "=H200"), ("model='>3'", ">3")])
    def test_a_quoted_value_may_start_with_an_operator_character(self, text: str, value: str) -> None:
        assert parse_selector(text) == Selector("model", SelectorOp.EQ, value)

    @pytest.mark.parametrize("text", ["model", "=H200", "1abc=2", "model=", "model =  ", "-x=1"])
    def test_not_a_selector(self, text: str) -> None:
        with pytest.raises(InvalidRequestError) as info:
            parse_selector(text, field="resource[0].selectors")
        assert info.value.field == "resource[0].selectors"
        assert "is not a selector" in info.value.message


class TestAValueThatStartsWithAnOperator:
    """``label=<none>`` is refused as ``=<`` mistyped, and the message also says how to compare with the text
    ``<none>``: quoted, twice in a text clause (split into words as a shell splits them), as the docs show. The
    hint was only ``write label<=none>``, the wrong thing for a value that is one."""

    @staticmethod
    def _written(message: str) -> str:
        hint = re.search(r"quote it: (.+)\)$", message)
        assert hint is not None, message
        return hint.group(1)

    @pytest.mark.parametrize(
        ("clause", "value", "written"),
        [
            ("gpu label=<none>", "<none>", """label='"<none>"'"""),
            ("gpu tag==x", "=x", """tag='"=x"'"""),
            ("gpu tag!=>x", ">x", """tag!='">x"'"""),
            ("host label=<none>", "<none>", """label='"<none>"'"""),
        ],
    )
    def test_text(self, clause: str, value: str, written: str) -> None:
        with pytest.raises(InvalidRequestError, match="is not an operator") as info:
            parse_request("t", [clause])
        assert info.value.field == "clauses[0]"
        assert self._written(info.value.message) == written
        typed = clause.split()[1]
        req = parse_request("t", [clause.replace(typed, written), "gpu"])
        (sel,) = req.host.selectors if clause.startswith("host") else req.resources[0].selectors
        assert (sel.key, sel.value) == (typed.split("=")[0].rstrip("!"), value)

    def test_the_hint_for_a_mistyped_operator_stays(self) -> None:
        with pytest.raises(InvalidRequestError, match="write label<=none>; ") as info:
            parse_resource("gpu label=<none>")
        assert "to compare with the text '<none>'" in info.value.message

    @pytest.mark.parametrize("where", ["resource", "host"])
    def test_document(self, where: str) -> None:
        def doc(selector: str) -> dict[str, Any]:
            if where == "host":
                return {"name": "t", "host": {"selectors": [selector]}, "resource": [{"kind": "gpu"}]}
            return {"name": "t", "resource": [{"kind": "gpu", "selectors": [selector]}]}

        with pytest.raises(InvalidRequestError, match="is not an operator") as info:
            request_from_document(doc("label=<none>"))
        written = self._written(info.value.message)
        assert written == 'label="<none>"'
        req = request_from_document(doc(written))
        (sel,) = req.host.selectors if where == "host" else req.resources[0].selectors
        assert sel == Selector("label", SelectorOp.EQ, "<none>")

    def test_the_documented_forms(self) -> None:
        """The docs' shell command, split as a shell splits it, and their document form compare with ``<none>``."""
        text = DOCS.read_text()
        (line,) = [x for x in text.splitlines() if x.startswith("disagg compose tagged ")]
        _, _, name, *clauses = shlex.split(line)
        assert parse_request(name, clauses).resources[0].selectors == (Selector("label", SelectorOp.EQ, "<none>"),)
        (selectors,) = re.findall(r"`(selectors = \[.*<none>.*\])`", text)
        parsed = tomllib.loads(selectors)["selectors"]
        request = request_from_document({"name": "t", "resource": [{"kind": "gpu", "selectors": parsed}]})
        assert request.resources[0].selectors == (Selector("label", SelectorOp.EQ, "<none>"),)

    @pytest.mark.parametrize("text", ["label==x", "label=>x", "label=<x", "label=<none>"])
    def test_still_refused(self, text: str) -> None:
        with pytest.raises(InvalidRequestError, match="is not an operator"):
            parse_selector(text)


class TestParseHost:
    """parse_host reads a host name, or minimum cores and memory plus selectors on host attributes."""

    @pytest.mark.parametrize("text", ["host h3", "h3", "  host   h3 "])
    def test_named(self, text: str) -> None:
        assert parse_host(text) == HostRequest(name="h3")

    def test_constraints(self) -> None:
        assert parse_host("host cores>=16 memory>=256GiB rack=r1") == HostRequest(
            min_cores=16,
            min_memory_bytes=256 * GiB,
            selectors=(Selector("rack", SelectorOp.EQ, "r1"),),
        )

    def test_single_selector_is_not_a_name(self) -> None:
        assert parse_host("host rack=r1") == HostRequest(selectors=(Selector("rack", SelectorOp.EQ, "r1"),))

    def test_bare_host_is_any_host(self) -> None:
        assert parse_host("host") == HostRequest()

    def test_quoted_selector_value(self) -> None:
        assert parse_host("host \"row='a b'\"").selectors == (Selector("row", SelectorOp.EQ, "a b"),)

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            ("host cores=16", "write cores>=VALUE"),
            ("host memory<=1TiB", "write memory>=VALUE"),
            ("host cores>=lots", "cores must be a whole number"),
            ("host cores>=-1", "cores must be a whole number"),
            ("host cores>=1.5", "cores must be a whole number"),
            ("host cores>=true", "cores must be a whole number"),
            ("host memory>=lots", "is not a size"),
            ("host memory>=-1", "is not a size"),
            ("host memory>=8Gi", "is not a size"),
            ("host cores>=8 cores>=16", "cores is given twice"),
            ("host memory>=1GiB memory>=2GiB", "memory is given twice"),
            ("host cores>=4294967296", "most a request may give"),
            ("host memory>=16384PiB", "most a request may give"),
            ("host memory>=true", "is not a size"),
            ("host h3 h4", "'h4' is not a selector"),
            ("host rack='r1", "cannot read"),
        ],
    )
    def test_errors_name_the_field(self, text: str, message: str) -> None:
        with pytest.raises(InvalidRequestError, match=message) as info:
            parse_host(text, field="clauses[0]")
        assert info.value.field == "clauses[0]"

    def test_default_field(self) -> None:
        with pytest.raises(InvalidRequestError) as info:
            parse_host("host cores=1")
        assert info.value.field == "host"


class TestParseResource:
    """parse_resource reads every clause form of a resource line in docs/request-language.md."""

    @pytest.mark.parametrize(
        ("text", "kind"),
        [
            ("gpu", DeviceKind.GPU),
            ("cxl-memory x2", DeviceKind.CXL_MEMORY),
            ("cxl x2", DeviceKind.CXL_MEMORY),
            ("memory x2", DeviceKind.CXL_MEMORY),
            ("nvme", DeviceKind.NVME),
            ("ssd", DeviceKind.NVME),
            ("nic", DeviceKind.NIC),
            ("fpga", DeviceKind.FPGA),
            ("dpu", DeviceKind.DPU),
        ],
    )
    def test_kinds(self, text: str, kind: DeviceKind) -> None:
        assert parse_resource(text).kind is kind

    @pytest.mark.parametrize(("text", "count"), [("gpu", 1), ("gpu x8", 8), ("gpu 8", 8), ("nic x1", 1)])
    def test_count(self, text: str, count: int) -> None:
        r = parse_resource(text)
        assert (r.count, r.amount_bytes) == (count, 0)

    @pytest.mark.parametrize(
        ("text", "amount"),
        [("cxl-memory 512GiB", 512 * GiB), ("cxl 1.5TiB", 3 * TiB // 2), ("memory 500GB", 500 * 10**9)],
    )
    def test_amount(self, text: str, amount: int) -> None:
        r = parse_resource(text)
        assert (r.count, r.amount_bytes, r.carved) == (0, amount, True)

    @pytest.mark.parametrize("op", list(SelectorOp))
    def test_selector_operators(self, op: SelectorOp) -> None:
        assert parse_resource(f"gpu x2 model{op.value}H200").selectors == (Selector("model", op, "H200"),)

    def test_size_selector_compares_bytes(self) -> None:
        r = parse_resource("gpu x2 model=H200 gpu_memory>=80GiB")
        assert r.selectors == (
            Selector("model", SelectorOp.EQ, "H200"),
            Selector("gpu_memory", SelectorOp.GE, 80 * GiB),
        )

    def test_quoted_selector(self) -> None:
        assert parse_resource("gpu \"model='H 200'\"").selectors == (Selector("model", SelectorOp.EQ, "H 200"),)

    @pytest.mark.parametrize(
        ("clause", "ns"),
        [("latency<=600ns", 600), ("latency<=1.2us", 1200), ("latency<=2ms", 2_000_000), ("latency<=750", 750)],
    )
    def test_latency(self, clause: str, ns: int) -> None:
        r = parse_resource(f"gpu x2 {clause}")
        assert r.max_latency_ns == ns
        assert r.selectors == ()

    def test_strict_latency_bound_excludes_the_bound(self) -> None:
        # ``latency<600ns`` is accepted; a device exactly 600 ns away must then not qualify.
        r = parse_resource("gpu x2 latency<600ns")
        assert r.max_latency_ns == 599

    @pytest.mark.parametrize("clause", ["same-switch", "affinity=same-switch"])
    def test_same_switch(self, clause: str) -> None:
        r = parse_resource(f"gpu x4 {clause}")
        assert r.affinity is Affinity.SAME_SWITCH
        assert r.selectors == ()

    def test_spread(self) -> None:
        r = parse_resource("gpu x4 spread=chassis")
        assert r.spread == "chassis"
        assert r.selectors == ()

    def test_defaults(self) -> None:
        r = parse_resource("gpu x2")
        assert (r.affinity, r.spread, r.max_latency_ns, r.selectors) == (Affinity.NONE, None, None, ())

    def test_full_line(self) -> None:
        r = parse_resource("gpu x8 model=H200 gpu_memory>=80GiB latency<=600ns same-switch spread=chassis")
        assert r == ResourceRequest(
            kind=DeviceKind.GPU,
            count=8,
            selectors=(
                Selector("model", SelectorOp.EQ, "H200"),
                Selector("gpu_memory", SelectorOp.GE, 80 * GiB),
            ),
            max_latency_ns=600,
            affinity=Affinity.SAME_SWITCH,
            spread="chassis",
        )

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            ("tpu x2", "unknown device kind 'tpu'; known kinds: gpu, cxl-memory"),
            ("gpu x-1", "is neither a count"),
            ("gpu xx8", "is neither a count"),
            ("cxl-memory 12QB", "is neither a count"),
            ("cxl-memory 0.1KiB", "is neither a count"),
            ("gpu x2 spread=", "spread= needs a failure-domain label"),
            ("gpu 80GiB", "only be carved from cxl-memory, not gpu"),
            ("nvme 1TiB", "only be carved from cxl-memory, not nvme"),
            ("gpu x2 latency<=fast", "not a latency"),
            ("gpu x2 latency<=-5ns", "not a latency"),
            ("gpu x8 x4", "is not a selector"),
            ("cxl 1GiB 2GiB", "is not a selector"),
            ("", "an empty resource"),
            ("   ", "an empty resource"),
            ("gpu model='H200", "cannot read"),
            ('gpu "model=H200', "cannot read"),
        ],
    )
    def test_errors_name_the_field(self, text: str, message: str) -> None:
        with pytest.raises(InvalidRequestError, match=message) as info:
            parse_resource(text, field="clauses[2]")
        assert info.value.field == "clauses[2]"

    def test_default_field(self) -> None:
        with pytest.raises(InvalidRequestError) as info:
            parse_resource("tpu")
        assert info.value.field == "resource"

    @pytest.mark.parametrize("text", ["gpu x0", "gpu 0", "nic x00"])
    def test_zero_count_is_refused(self, text: str) -> None:
        with pytest.raises(InvalidRequestError) as info:
            parse_resource(text, field="clauses[0]")
        assert info.value.field == "clauses[0]"

    @pytest.mark.parametrize("text", ["cxl-memory 0GiB", "cxl 0B"])
    def test_zero_amount_is_refused(self, text: str) -> None:
        with pytest.raises(InvalidRequestError) as info:
            parse_resource(text, field="clauses[0]")
        assert info.value.field == "clauses[0]"

    def test_fractional_size_in_a_selector(self) -> None:
        with pytest.raises(InvalidRequestError, match="not a whole number of bytes") as info:
            parse_resource("gpu x2 gpu_memory>=0.1KiB", field="clauses[0]")
        assert info.value.field == "clauses[0]"


class TestParseRequest:
    """parse_request joins text clauses into one request, naming the clause of any error."""

    def test_docs_example_in_one_argument(self) -> None:
        req = parse_request("inference", ["host memory>=512GiB; gpu x2 model=H200 latency<=600ns; cxl-memory 512GiB"])
        assert req == CompositionRequest(
            name="inference",
            host=HostRequest(min_memory_bytes=512 * GiB),
            resources=(
                ResourceRequest(
                    DeviceKind.GPU, count=2, selectors=(Selector("model", SelectorOp.EQ, "H200"),), max_latency_ns=600
                ),
                ResourceRequest(DeviceKind.CXL_MEMORY, amount_bytes=512 * GiB),
            ),
        )

    def test_docs_example_in_separate_arguments(self) -> None:
        req = parse_request("training", ["host cores>=8", "gpu x8 model=H200 same-switch"])
        assert req.host == HostRequest(min_cores=8)
        assert req.resources == (
            ResourceRequest(
                DeviceKind.GPU,
                count=8,
                selectors=(Selector("model", SelectorOp.EQ, "H200"),),
                affinity=Affinity.SAME_SWITCH,
            ),
        )

    def test_host_clause_anywhere(self) -> None:
        req = parse_request("a", ["gpu x1", "host h3", "nic"])
        assert req.host == HostRequest(name="h3")
        assert [r.kind for r in req.resources] == [DeviceKind.GPU, DeviceKind.NIC]

    def test_no_host_clause_means_any_host(self) -> None:
        assert parse_request("a", ["gpu"]).host == HostRequest()

    def test_empty_parts_are_ignored(self) -> None:
        assert len(parse_request("a", [";; gpu ;", "", "nic;"]).resources) == 2

    def test_resource_order_is_kept(self) -> None:
        req = parse_request("a", ["nic", "gpu x2", "cxl 1GiB", "nvme"])
        assert [r.kind for r in req.resources] == [
            DeviceKind.NIC,
            DeviceKind.GPU,
            DeviceKind.CXL_MEMORY,
            DeviceKind.NVME,
        ]

    @pytest.mark.parametrize(
        ("clauses", "field"),
        [
            (["tpu"], "clauses[0]"),
            (["host h3", "gpu x2", "tpu"], "clauses[2]"),
            (["gpu x2", "host cores=4"], "clauses[1]"),
            (["gpu 80GiB"], "clauses[0]"),
        ],
    )
    def test_error_names_the_clause(self, clauses: list[str], field: str) -> None:
        with pytest.raises(InvalidRequestError) as info:
            parse_request("a", clauses)
        assert info.value.field == field

    @pytest.mark.parametrize("name", ["a", "0", "train-1", "A.b_c-1", "x" * 63])
    def test_valid_names(self, name: str) -> None:
        assert parse_request(name, ["gpu"]).name == name

    @pytest.mark.parametrize("name", ["", "-a", ".a", "_a", "a b", "a/b", "x" * 64, "é"])
    def test_invalid_names(self, name: str) -> None:
        with pytest.raises(InvalidRequestError, match="invalid composition name") as info:
            parse_request(name, ["gpu"])
        assert info.value.field == "name"

    @pytest.mark.parametrize("clauses", [[], [""], [" ; ; "], ["host h3"]])
    def test_empty_request(self, clauses: list[str]) -> None:
        with pytest.raises(InvalidRequestError, match="at least one resource") as info:
            parse_request("a", clauses)
        assert info.value.field == "resources"


DOC_EXAMPLE = """
name = "inference"

[host]
min_memory = "512GiB"

[[resource]]
kind = "gpu"
count = 2
selectors = ["model=H200", "gpu_memory>=80GiB"]
max_latency = "600ns"
affinity = "same-switch"
spread = "chassis"

[[resource]]
kind = "cxl-memory"
amount = "512GiB"
"""

DOC_EXPECTED = CompositionRequest(
    name="inference",
    host=HostRequest(min_memory_bytes=512 * GiB),
    resources=(
        ResourceRequest(
            DeviceKind.GPU,
            count=2,
            selectors=(Selector("model", SelectorOp.EQ, "H200"), Selector("gpu_memory", SelectorOp.GE, 80 * GiB)),
            max_latency_ns=600,
            affinity=Affinity.SAME_SWITCH,
            spread="chassis",
        ),
        ResourceRequest(DeviceKind.CXL_MEMORY, amount_bytes=512 * GiB),
    ),
)


def _doc(**host: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": "a", "resource": [{"kind": "gpu", "count": 1}]}
    if host:
        doc["host"] = host
    return doc


class TestRequestFromDocument:
    """request_from_document reads the TOML/JSON form; unknown fields and bad values name the offending field."""

    def test_docs_toml_example(self) -> None:
        assert request_from_document(tomllib.loads(DOC_EXAMPLE)) == DOC_EXPECTED

    def test_json_with_the_same_fields(self) -> None:
        text = json.dumps(tomllib.loads(DOC_EXAMPLE))
        assert request_from_document(json.loads(text)) == DOC_EXPECTED

    def test_host_by_name_in_table(self) -> None:
        assert request_from_document(_doc(name="h3")).host == HostRequest(name="h3")

    def test_host_as_text(self) -> None:
        doc = _doc()
        doc["host"] = "h3"
        assert request_from_document(doc).host == HostRequest(name="h3")

    def test_host_constraints(self) -> None:
        host = request_from_document(_doc(min_cores=16, min_memory=256 * GiB, selectors=["rack=r1"])).host
        assert host == HostRequest(
            min_cores=16, min_memory_bytes=256 * GiB, selectors=(Selector("rack", SelectorOp.EQ, "r1"),)
        )

    def test_numbers_as_numbers(self) -> None:
        doc = {
            "name": "a",
            "resource": [{"kind": "cxl", "amount": GiB}, {"kind": "gpu", "count": 1, "max_latency": 500}],
        }
        req = request_from_document(doc)
        assert req.resources[0].amount_bytes == GiB
        assert req.resources[1].max_latency_ns == 500

    def test_affinity_none(self) -> None:
        doc = {"name": "a", "resource": [{"kind": "gpu", "count": 1, "affinity": "none"}]}
        assert request_from_document(doc).resources[0].affinity is Affinity.NONE

    def test_resources_spelled_plural(self) -> None:
        doc = {"name": "a", "resources": [{"kind": "nic", "count": 2}]}
        assert request_from_document(doc).resources == (ResourceRequest(DeviceKind.NIC, count=2),)

    @pytest.mark.parametrize(
        ("doc", "field", "message"),
        [
            ({"name": "a", "resource": [], "names": "x"}, "names", "unknown request fields: names"),
            ({"name": "a", "resource": [], "zz": 1, "aa": 2}, "aa", "unknown request fields: aa, zz"),
            ({"resource": [{"kind": "gpu", "count": 1}]}, "name", "invalid composition name"),
            ({"name": "a b", "resource": [{"kind": "gpu", "count": 1}]}, "name", "invalid composition name"),
            ({"name": "a", "resource": []}, "resources", "at least one resource"),
            ({"name": "a"}, "resources", "at least one resource"),
            ({"name": "a", "host": 3, "resource": []}, "host", "host must be a name or a table"),
            ({"name": "a", "resource": {"kind": "gpu"}}, "resource", "resource must be a list of tables"),
            ({"name": "a", "resource": ["gpu x1"]}, "resource[0]", "each resource must be a table"),
        ],
    )
    def test_top_level_errors(self, doc: dict[str, Any], field: str, message: str) -> None:
        with pytest.raises(InvalidRequestError, match=message) as info:
            request_from_document(doc)
        assert info.value.field == field

    @pytest.mark.parametrize(
        ("host", "field", "message"),
        [
            ({"cores": 4}, "host", "unknown host fields: cores"),
            ({"min_memory": "lots"}, "host.min_memory", "not a size"),
            ({"min_memory": -1}, "host.min_memory", "must not be negative"),
            ({"min_cores": -1}, "host.min_cores", "min_cores must be a whole number"),
            ({"min_cores": "8"}, "host.min_cores", "min_cores must be a whole number"),
            ({"min_cores": 1.5}, "host.min_cores", "min_cores must be a whole number"),
            ({"selectors": ["rack"]}, "host.selectors[0]", "is not a selector"),
        ],
    )
    def test_bad_host_fields(self, host: dict[str, Any], field: str, message: str) -> None:
        with pytest.raises(InvalidRequestError, match=message) as info:
            request_from_document(_doc(**host))
        assert info.value.field == field

    def test_min_cores_true_is_not_a_number(self) -> None:
        with pytest.raises(InvalidRequestError, match="min_cores must be a whole number") as info:
            request_from_document(_doc(min_cores=True))
        assert info.value.field == "host.min_cores"

    @pytest.mark.parametrize("value", [1.5, 1024.0])
    def test_float_amount_is_an_invalid_request(self, value: float) -> None:
        doc = {"name": "a", "resource": [{"kind": "cxl", "amount": value}]}
        with pytest.raises(InvalidRequestError) as info:
            request_from_document(doc)
        assert info.value.field == "resource[0].amount"

    def test_empty_spread_is_refused_as_in_text(self) -> None:
        doc = {"name": "a", "resource": [{"kind": "gpu", "count": 2, "spread": ""}]}
        with pytest.raises(InvalidRequestError, match="spread") as info:
            request_from_document(doc)
        assert info.value.field == "resource[0].spread"

    def test_host_text_error(self) -> None:
        doc = _doc()
        doc["host"] = "cores=4"
        with pytest.raises(InvalidRequestError) as info:
            request_from_document(doc)
        assert info.value.field == "host"

    @pytest.mark.parametrize(
        ("resource", "field", "message"),
        [
            ({"kind": "gpu", "count": 1, "model": "H200"}, "resource[1]", "unknown resource fields: model"),
            ({"kind": "tpu", "count": 1}, "resource[1].kind", "unknown device kind 'tpu'"),
            ({"count": 1}, "resource[1].kind", "unknown device kind ''"),
            ({"kind": "gpu", "count": "2"}, "resource[1].count", "count must be a whole number"),
            ({"kind": "gpu", "count": True}, "resource[1].count", "count must be a whole number"),
            ({"kind": "gpu", "count": 1.5}, "resource[1].count", "count must be a whole number"),
            ({"kind": "gpu", "count": -2}, "resource[1].count", "count must be a whole number"),
            ({"kind": "gpu", "amount": "80GiB"}, "resource[1]", "only be carved from cxl-memory, not gpu"),
            ({"kind": "cxl", "count": 1, "amount": "1GiB"}, "resource[1]", "exactly one of a count or an amount"),
            ({"kind": "cxl", "amount": "lots"}, "resource[1].amount", "not a size"),
            ({"kind": "cxl", "amount": "0.1KiB"}, "resource[1].amount", "not a whole number of bytes"),
            ({"kind": "gpu", "count": 1, "max_latency": "soon"}, "resource[1].max_latency", "not a latency"),
            ({"kind": "gpu", "count": 1, "max_latency": -1}, "resource[1].max_latency", "must not be negative"),
            ({"kind": "gpu", "count": 1, "affinity": "near"}, "resource[1].affinity", "'near' is not a valid Affinity"),
            ({"kind": "gpu", "count": 1, "selectors": ["model"]}, "resource[1].selectors[0]", "is not a selector"),
        ],
    )
    def test_bad_resource_fields(self, resource: dict[str, Any], field: str, message: str | None) -> None:
        doc = {"name": "a", "resource": [{"kind": "nic", "count": 1}, resource]}
        with pytest.raises(InvalidRequestError, match=message) as info:
            request_from_document(doc)
        assert info.value.field == field


class TestMistakesAreRefused:
    """Input that used to be dropped, taken for something else, or crash is refused with the field it is in."""

    @pytest.mark.parametrize(
        ("doc", "field", "message"),
        [
            ([{"kind": "gpu", "count": 1}], "request", "a request document is a table"),
            (
                {"name": "a", "resource": [{"kind": "gpu", "count": 1}], "resources": [{"kind": "nic", "count": 1}]},
                "resources",
                "not both",
            ),
            ({"name": None, "resource": [{"kind": "gpu"}]}, "name", "name must be text"),
            ({"name": 123, "resource": [{"kind": "gpu"}]}, "name", "name must be text"),
            (
                {"name": "a", "resource": [{"kind": "gpu", "selectors": "model=H200"}]},
                "resource[0].selectors",
                "a list",
            ),
            ({"name": "a", "resource": [{"kind": "gpu", "selectors": [5]}]}, "resource[0].selectors[0]", "as text"),
            ({"name": "a", "host": {"selectors": [1]}, "resource": [{"kind": "gpu"}]}, "host.selectors[0]", "as text"),
            ({"name": "a", "host": {"name": ""}, "resource": [{"kind": "gpu"}]}, "host.name", "must name a host"),
            (
                {"name": "a", "host": {"selectors": ["cores>=16"]}, "resource": [{"kind": "gpu"}]},
                "host.selectors[0]",
                "min_cores",
            ),
            (
                {"name": "a", "resource": [{"kind": "gpu", "selectors": ["model=H200", "latency<=600ns"]}]},
                "resource[0].selectors[1]",
                "latency<=VALUE",
            ),
            (
                {"name": "a", "resource": [{"kind": "gpu", "selectors": ["serial=SN-1"]}]},
                "resource[0].selectors[0]",
                "names one device",
            ),
        ],
    )
    def test_documents(self, doc: Any, field: str, message: str) -> None:
        with pytest.raises(InvalidRequestError, match=message) as info:
            request_from_document(doc)
        assert info.value.field == field

    def test_a_document_line_without_count_or_amount_is_one_device(self) -> None:
        doc = {"name": "a", "resource": [{"kind": "gpu"}]}
        assert request_from_document(doc).resources == (ResourceRequest(DeviceKind.GPU, count=1),)

    @pytest.mark.parametrize(
        ("clauses", "field", "message"),
        [
            (["host h1; host h3; gpu"], "clauses[1]", "one host clause"),
            (["host cores>=8; gpu x2", "nvme lots"], "clauses[2]", "neither a count"),
            (["gpu latency>=100ns"], "clauses[0]", "latency<=VALUE"),
            (["gpu latency=600ns"], "clauses[0]", "latency<=VALUE"),
            (["gpu affinity=none"], "clauses[0]", "only affinity is same-switch"),
            (["gpu serial=SN-1"], "clauses[0]", "'serial' names one device"),
            (["nic id=pcie0/nic0"], "clauses[0]", "'id' names one device"),
            (["gpu x2 gpu_memory>=80G"], "clauses[0]", "80GB or 80GiB"),
        ],
    )
    def test_text(self, clauses: list[str], field: str, message: str) -> None:
        with pytest.raises(InvalidRequestError, match=message) as info:
            parse_request("t", clauses)
        assert info.value.field == field

    def test_a_host_name_with_minimums(self) -> None:
        assert parse_request("t", ["host h1 cores>=64", "gpu"]).host == HostRequest(name="h1", min_cores=64)

    def test_a_word_after_the_host_is_no_name(self) -> None:
        """Only the first word names the host: a later one is a mistyped selector, not a host called rack:r1."""
        with pytest.raises(InvalidRequestError, match="'rack:r1' is not a selector"):
            parse_request("t", ["host cores>=16 rack:r1", "gpu"])

    @pytest.mark.parametrize(("label", "selector"), [("1", "rack=1"), ("1b", "rack=1b"), ("2.5", "rack=2.5")])
    def test_a_label_that_looks_like_a_number(self, label: str, selector: str) -> None:
        """Failure-domain labels are text; a selector written with the same characters matches it."""
        host = Host("h1", 8, 1 << 30, failure_domains={"rack": label})
        assert parse_selector(selector).matches(host.attribute("rack"))
        assert not parse_selector(selector.replace("=", "!=")).matches(host.attribute("rack"))

    def test_truth_is_not_a_number(self) -> None:
        assert not Selector("sockets", SelectorOp.EQ, True).matches(1)
        assert Selector("sockets", SelectorOp.NE, True).matches(1)
        assert Selector("sockets", SelectorOp.EQ, True).matches(True)


class TestNumbersTheWireCarries:
    """A count, amount, latency bound or selector number the protocol cannot carry is refused however the request
    is written: with --server it crashed the client building the message, while the local composer answered."""

    @pytest.mark.parametrize(
        ("clause", "message"),
        [
            ("gpu x4294967296", "a count of 4294967296"),
            ("gpu x99999999999999999999", "a count of"),
            ("cxl 16384PiB", "an amount of bytes"),
            ("cxl 99999999999PiB", "an amount of bytes"),
            ("gpu latency<=18446744073710ms", "a latency bound"),
            ("gpu k>=9223372036854775808", "beyond the whole numbers"),
            ("gpu k>=-9223372036854775809", "beyond the whole numbers"),
            ("gpu k>=99999999999999999999999999", "beyond the whole numbers"),
            ("gpu k>=" + "9" * 400 + ".0", "not a number a device can have"),
            ("host k!=9223372036854775808; gpu", "beyond the whole numbers"),
            ("host cores>=4294967296; gpu", "a minimum of cores"),
            ("host memory>=16384PiB; gpu", "a minimum of memory"),
        ],
    )
    def test_text(self, clause: str, message: str) -> None:
        with pytest.raises(InvalidRequestError, match=message) as info:
            parse_request("t", [clause])
        assert info.value.field.startswith("clauses[")

    def test_the_limits_themselves_are_taken(self) -> None:
        req = parse_request(
            "t",
            [
                "host cores>=4294967295 memory>=18446744073709551615",
                "gpu x4294967295 k>=9223372036854775807 j>=-9223372036854775808",
                "gpu latency<=18446744073709551615ns",
                "cxl 18446744073709551615B",
            ],
        )
        assert req.host.min_cores == 2**32 - 1 and req.host.min_memory_bytes == 2**64 - 1
        assert req.resources[0].count == 2**32 - 1
        assert [s.value for s in req.resources[0].selectors] == [2**63 - 1, -(2**63)]
        assert req.resources[1].max_latency_ns == 2**64 - 1
        assert req.resources[2].amount_bytes == 2**64 - 1

    @pytest.mark.parametrize(
        ("resource", "field"),
        [
            ({"kind": "gpu", "count": 2**32}, "resource[0]"),
            ({"kind": "cxl", "amount": 2**64}, "resource[0]"),
            ({"kind": "cxl", "amount": "16384PiB"}, "resource[0]"),
            ({"kind": "gpu", "max_latency": 2**64}, "resource[0]"),
            ({"kind": "gpu", "max_latency": "18446744073710ms"}, "resource[0]"),
            ({"kind": "gpu", "selectors": [f"k>={2**63}"]}, "resource[0].selectors[0]"),
        ],
    )
    def test_documents(self, resource: dict[str, Any], field: str) -> None:
        with pytest.raises(InvalidRequestError) as info:
            request_from_document({"name": "t", "resource": [resource]})
        assert info.value.field == field

    @pytest.mark.parametrize(("host", "field"), [({"min_cores": 2**32}, "host"), ({"min_memory": 2**64}, "host")])
    def test_host_documents(self, host: dict[str, Any], field: str) -> None:
        with pytest.raises(InvalidRequestError) as info:
            request_from_document({"name": "t", "host": host, "resource": [{"kind": "gpu"}]})
        assert info.value.field == field


class TestNumbersInOtherNotations:
    """A number written as ``8e10``, ``0x10``, ``1_000``, ``+5`` or ``.5`` was read as text, which compares with no
    number: ``gpu_memory>=8e10`` matched no device, silently. It is refused with the number meant; quoted, it is
    the text it reads as."""

    @pytest.mark.parametrize(
        ("selector", "meant"),
        [
            ("gpu_memory>=8e10", "gpu_memory>=80000000000"),
            ("score>=1.5E3", "score>=1500"),
            ("score<=1e-3", "score<=0.001"),
            ("score>-2.5e2", "score>-250"),
            ("vendor_id=0x10de", "vendor_id=4318"),
            ("mask=0b101", "mask=5"),
            ("mode=0o17", "mode=15"),
            ("cores!=1_000", "cores!=1000"),
            ("slot=+5", "slot=5"),
            ("ratio<.5", "ratio<0.5"),
        ],
    )
    def test_refused_with_the_number_meant(self, selector: str, meant: str) -> None:
        with pytest.raises(InvalidRequestError, match="is not a number the request language reads") as info:
            parse_resource(f"gpu {selector}", field="clauses[0]")
        assert f"write {meant}," in info.value.message
        assert info.value.field == "clauses[0]"
        with pytest.raises(InvalidRequestError, match=f"write {re.escape(meant)},") as info:
            request_from_document({"name": "t", "resource": [{"kind": "gpu", "selectors": [selector]}]})
        assert info.value.field == "resource[0].selectors[0]"

    @pytest.mark.parametrize("selector", ["score>=1e999999999", "score>=1e40", "score>=1e-40"])
    def test_a_number_too_long_to_write_out_gets_a_general_hint(self, selector: str) -> None:
        with pytest.raises(InvalidRequestError, match="write it in digits") as info:
            parse_selector(selector)
        assert len(info.value.message) < 300

    def test_quoted_it_is_text(self) -> None:
        """The hint's quoting is the one the words of a clause need (a shell's layer comes off as they split)."""
        with pytest.raises(InvalidRequestError) as info:
            parse_resource("gpu vendor_id=0x10de", field="clauses[0]")
        hinted = info.value.message.rsplit("quote it: ", 1)[1]
        assert hinted == "vendor_id='\"0x10de\"'"
        text = Selector("vendor_id", SelectorOp.EQ, "0x10de")
        assert parse_request("t", [f"gpu {hinted}"]).resources[0].selectors == (text,)
        document = {"name": "t", "resource": [{"kind": "gpu", "selectors": ['vendor_id="0x10de"']}]}
        assert request_from_document(document).resources[0].selectors == (text,)
        assert text.matches("0x10de") and not text.matches(4318)

    @pytest.mark.parametrize(
        "value", ["7e5a", "0x", "1e", "e10", "1.2.3", "-", "5.", "12", "-3.25", "80GB", "0bad", "0bed", "0o9", "0b12"]
    )
    def test_what_is_not_a_number_in_another_notation(self, value: str) -> None:
        """Text that only starts like a number, and the numbers the language reads, are taken as before."""
        assert parse_selector(f"k={value}").value == parse_value(value)


class TestLongSelectorText:
    """Text over 256 characters was taken by the local composer and the request forms while every server refused
    it: the same request now fails alike everywhere, naming its field."""

    def test_text_and_documents(self) -> None:
        at = "v" * MAX_SELECTOR_TEXT
        assert parse_request("t", [f"gpu model={at}"]).resources[0].selectors[0].value == at
        with pytest.raises(InvalidRequestError, match="at most 256 characters, not 257") as info:
            parse_request("t", ["gpu", f"gpu model={at}v"])
        assert info.value.field == "clauses[1]"
        with pytest.raises(InvalidRequestError, match="at most 256 characters") as info:
            request_from_document({"name": "t", "host": {"selectors": [f"rack={at}v"]}, "resource": [{"kind": "gpu"}]})
        assert info.value.field == "host.selectors[0]"

    def test_the_model_rule(self) -> None:
        line = ResourceRequest(DeviceKind.GPU, 1, selectors=(Selector("model", SelectorOp.EQ, "v" * 257),))
        assert request_limit_refusal((line,)) == (
            "resources[0].selectors[0].value",
            "a selector compares with text of at most 256 characters, not 257",
        )
        assert selector_value_refusal("v" * 256) == ""


class TestEachModifierOnce:
    """A modifier given twice in one clause is refused: the last one silently won."""

    @pytest.mark.parametrize(
        ("clause", "modifier"),
        [
            ("gpu x2 spread=chassis spread=rack", "spread"),
            ("gpu x2 latency<=600ns latency<=500ns", "latency"),
            ("gpu x2 latency<600ns latency<=500ns", "latency"),
            ("gpu x2 same-switch affinity=same-switch", "same-switch"),
        ],
    )
    def test_resource(self, clause: str, modifier: str) -> None:
        with pytest.raises(InvalidRequestError, match=f"{modifier} is given twice") as info:
            parse_resource(clause, field="clauses[0]")
        assert info.value.field == "clauses[0]"

    def test_host_minimums_at_zero_ask_nothing(self) -> None:
        """``memory>=0`` was refused as "not a size", while ``cores>=0`` and a document's ``min_memory = 0`` are
        taken: both are now no minimum."""
        assert parse_host("host cores>=0 memory>=0") == HostRequest()


class TestLatencyMeansWhatIsWritten:
    """A latency bound is a whole number of ns: a fraction was rounded, so ``latency<=349.5ns`` admitted a 350 ns
    device, and ``latency<1.5ns`` became ``<=1``."""

    @pytest.mark.parametrize("clause", ["gpu latency<=349.5ns", "gpu latency<=1.5ns", "gpu latency<2.5ns"])
    def test_a_fraction_of_a_ns_is_refused(self, clause: str) -> None:
        with pytest.raises(InvalidRequestError, match="not a whole number of ns") as info:
            parse_resource(clause, field="clauses[0]")
        assert info.value.field == "clauses[0]"

    @pytest.mark.parametrize(
        ("clause", "ns"), [("gpu latency<=1.5us", 1500), ("gpu latency<1.5us", 1499), ("gpu latency<0.35us", 349)]
    )
    def test_a_fraction_of_a_larger_unit_is_exact(self, clause: str, ns: int) -> None:
        assert parse_resource(clause).max_latency_ns == ns

    def test_documents(self) -> None:
        with pytest.raises(InvalidRequestError, match="not a whole number of ns") as info:
            request_from_document({"name": "t", "resource": [{"kind": "gpu", "max_latency": "349.5ns"}]})
        assert info.value.field == "resource[0].max_latency"


class TestClippedSizes:
    """A size whose B was left out (``80G``, ``80Gi``) is refused rather than compared as text."""

    @pytest.mark.parametrize(
        ("clause", "unit"), [("gpu gpu_memory>=80Gi", "80GiB"), ("gpu gpu_memory<1.5ti", "1.5tiB")]
    )
    def test_binary_unit_without_its_b(self, clause: str, unit: str) -> None:
        with pytest.raises(InvalidRequestError, match=f"unit in full, {unit}$"):
            parse_resource(clause)


def test_a_number_too_large_to_be_finite_is_refused() -> None:
    """Four hundred nines and a point read as infinity, which the wire refuses: refused here, as the model no
    longer does (a ledger may hold one)."""
    with pytest.raises(InvalidRequestError, match="is not a number a device can have"):
        parse_resource("gpu score>=" + "9" * 400 + ".0")


class TestACountOfTooManyDigits:
    """A count longer than Python reads as an int (4300 digits) raised its ValueError instead of the request
    language's refusal of a count out of range."""

    @pytest.mark.parametrize("count", ["x" + "9" * 4301, "9" * 4301, "x" + "9" * 100_000])
    def test_text(self, count: str) -> None:
        with pytest.raises(InvalidRequestError, match="is more than the most a request may give, 4294967295") as info:
            parse_resource(f"gpu {count}", field="clauses[0]")
        assert info.value.field == "clauses[0]" and len(info.value.message) < 200

    def test_leading_zeros_are_no_more(self) -> None:
        assert parse_resource("gpu x" + "0" * 5000 + "8").count == 8


class TestSpreadLabels:
    """``spread`` names a failure-domain label as the wire does (1-63 letters, digits, '.', '_', '-'): one that
    cannot be one was a NoFitError locally (exit 3) but INVALID_ARGUMENT through a server (exit 2)."""

    @pytest.mark.parametrize("label", ["chassis=a", "a b", "é", "-rack", "r" * 64])
    def test_text(self, label: str) -> None:
        with pytest.raises(InvalidRequestError, match="is not a failure-domain label") as info:
            parse_request("t", [f"gpu x2 {shlex.quote('spread=' + label)}"])
        assert info.value.field == "clauses[0]"

    @pytest.mark.parametrize("label", ["chassis=a", "a b", "é", "-rack", "r" * 64])
    def test_documents(self, label: str) -> None:
        with pytest.raises(InvalidRequestError, match="is not a failure-domain label") as info:
            request_from_document({"name": "t", "resource": [{"kind": "gpu", "count": 2, "spread": label}]})
        assert info.value.field == "resource[0].spread"

    @pytest.mark.parametrize("label", ["chassis", "power-feed", "rack.1", "r" * 63, "0"])
    def test_labels_are_taken(self, label: str) -> None:
        assert parse_resource(f"gpu x2 spread={label}").spread == label


class TestAnAmountHasAUnit:
    """``cxl-memory 512.0`` was 512 bytes while ``cxl-memory 512`` is 512 devices: a bare decimal is refused."""

    @pytest.mark.parametrize(("amount", "hint"), [("512.0", "512GiB"), ("1.5", "1.5GiB"), ("0.25", "0.25GiB")])
    def test_text(self, amount: str, hint: str) -> None:
        with pytest.raises(InvalidRequestError, match=f"has no unit.*{re.escape(hint)}\\?") as info:
            parse_resource(f"cxl-memory {amount}", field="clauses[0]")
        assert info.value.field == "clauses[0]"

    @pytest.mark.parametrize(("amount", "nbytes"), [("512B", 512), ("512.0GiB", 512 * GiB), ("1.5KiB", 1536)])
    def test_with_a_unit(self, amount: str, nbytes: int) -> None:
        assert parse_resource(f"cxl-memory {amount}").amount_bytes == nbytes


class TestDocumentKeysAreText:
    """A key that is not text (a dict given from Python) raised TypeError sorting or joining the unknown ones."""

    @pytest.mark.parametrize(
        ("doc", "field"),
        [
            ({1: 2}, "request"),
            ({"name": "t", 1: 2, "b": 3, "resource": [{"kind": "gpu"}]}, "request"),
            ({"name": "t", "host": {None: 1}, "resource": [{"kind": "gpu"}]}, "host"),
            ({"name": "t", "resource": [{"kind": "gpu", 3.5: "x"}]}, "resource[0]"),
        ],
    )
    def test_refused_naming_the_key(self, doc: dict[Any, Any], field: str) -> None:
        with pytest.raises(InvalidRequestError, match="is not a field name") as info:
            request_from_document(doc)
        assert info.value.field == field


class TestTextTheWireCannotCarry:
    """Text the wire cannot carry was taken: a lone surrogate (a byte that is not UTF-8 on a command line, a
    ``\\ud800`` escape in a JSON file) in a selector's value or the host's name made the Python client raise a
    bare UnicodeEncodeError, and the local composer answered NoFitError or UnknownHostError for it."""

    @pytest.mark.parametrize(
        ("clauses", "field"),
        [
            (["gpu model=\udcff"], "clauses[0]"),
            (["host rack=a\ud800", "gpu"], "clauses[0]"),
            (["host h1 model=\udcff", "gpu"], "clauses[0]"),
            (["gpu", "nvme x1 model=\udcff"], "clauses[1]"),
        ],
    )
    def test_text(self, clauses: list[str], field: str) -> None:
        with pytest.raises(InvalidRequestError, match="not UTF-8") as info:
            parse_request("t", clauses)
        assert info.value.field == field

    @pytest.mark.parametrize(
        ("doc", "field"),
        [
            ({"resource": [{"kind": "gpu", "selectors": ["model=\ud800"]}]}, "resource[0]"),
            ({"host": {"selectors": ["rack=\ud800"]}, "resource": [{"kind": "gpu"}]}, "host"),
        ],
    )
    def test_documents(self, doc: dict[str, Any], field: str) -> None:
        with pytest.raises(InvalidRequestError, match="not UTF-8") as info:
            request_from_document({"name": "t", **doc})
        assert info.value.field == field


class TestAHostNameIsAnId:
    """A host's name is an id as drivers report them and the server reads them (1 to 256 printable characters
    without spaces): one with a space, a control character or thousands of characters was taken, and the local
    composer answered UnknownHostError (exit 4) where a server refused the request (exit 2)."""

    @pytest.mark.parametrize("name", ["h\x00", "h\x1b[1m", "h 3", "h" * 257, "host\xa0h3", "h\udcff"])
    def test_refused(self, name: str) -> None:
        with pytest.raises(InvalidRequestError, match="a host name is 1 to 256 printable characters") as info:
            parse_request("t", [f"host {shlex.quote(name)}", "gpu"])
        assert info.value.field == "clauses[0]"
        with pytest.raises(InvalidRequestError, match="a host name is 1 to 256") as info:
            request_from_document({"name": "t", "host": {"name": name}, "resource": [{"kind": "gpu"}]})
        assert info.value.field == "host.name"

    @pytest.mark.parametrize("name", ["h3", "h" * 256, "rack1/node-é"])
    def test_taken(self, name: str) -> None:
        assert parse_host(f"host {name}").name == name


class TestANumberOfTooManyDigits:
    """A number longer than Python reads as an int (4300 digits) in a latency, a size or a selector was refused
    with Python's own message, which tells the user to call ``sys.set_int_max_str_digits()``; the refusal says
    the number is too large, and names it by its length."""

    @pytest.mark.parametrize(
        "clause",
        [
            "gpu latency<=" + "9" * 5000 + "ns",
            "gpu latency<" + "9" * 5000 + ".5us",
            "gpu gpu_memory>=" + "9" * 5000 + "GiB",
            "gpu gpu_memory>=1." + "0" * 5000 + "GiB",
            "gpu score>=" + "9" * 5000,
            "gpu score<=-" + "9" * 5000,
            "host memory>=" + "9" * 5000 + "GiB",
            "host cores>=" + "9" * 5000,
        ],
    )
    def test_text(self, clause: str) -> None:
        with pytest.raises(InvalidRequestError, match=r"5,00[0-9] digits") as info:
            parse_request("t", [clause, "nvme"])
        assert "set_int_max_str_digits" not in info.value.message
        assert info.value.field == "clauses[0]"

    @pytest.mark.parametrize(
        ("doc", "field"),
        [
            ({"resource": [{"kind": "gpu", "max_latency": "9" * 5000 + "ns"}]}, "resource[0].max_latency"),
            ({"resource": [{"kind": "cxl-memory", "amount": "9" * 5000 + "GiB"}]}, "resource[0].amount"),
            ({"host": {"min_memory": "9" * 5000 + "GiB"}, "resource": [{"kind": "gpu"}]}, "host.min_memory"),
        ],
    )
    def test_documents(self, doc: dict[str, Any], field: str) -> None:
        with pytest.raises(InvalidRequestError, match="5,000 digits") as info:
            request_from_document({"name": "t", **doc})
        assert "set_int_max_str_digits" not in info.value.message
        assert info.value.field == field


class TestNoNumberThatIsNotFinite:
    """``gpu_memory>=inf`` or ``score<nan`` was text, which no number is ordered with: the selector matched no
    device, silently. Unquoted under an ordering operator it is refused, as the number it looks like would be;
    quoted, it is that text."""

    @pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "+inf", "Infinity", "-Infinity"])
    @pytest.mark.parametrize("op", [">=", "<=", ">", "<"])
    def test_refused(self, value: str, op: str) -> None:
        with pytest.raises(InvalidRequestError, match="not a number a device can have") as info:
            parse_request("t", [f"gpu score{op}{value}"])
        assert info.value.field == "clauses[0]"
        assert f"""score{op}'"{value}"'""" in info.value.message
        with pytest.raises(InvalidRequestError, match="not a number a device can have") as info:
            request_from_document({"name": "t", "resource": [{"kind": "gpu", "selectors": [f"score{op}{value}"]}]})
        assert info.value.field == "resource[0].selectors[0]"
        assert f'score{op}"{value}"' in info.value.message

    @pytest.mark.parametrize("selector", ["score>='\"inf\"'", "model=nan", "model!=inf", "score>=info", "x<nano"])
    def test_text_is_taken(self, selector: str) -> None:
        parse_request("t", [f"gpu {selector}"])


class TestTheWiresCountsAndLengths:
    """A request of more resource lines (64) or selectors on a line or the host (32), or a selector key longer
    (63 characters), than a server reads was taken by the request language, so that the local composer composed
    what a server refuses."""

    def test_lines(self) -> None:
        assert len(parse_request("t", ["nvme"] * 64).resources) == 64
        with pytest.raises(InvalidRequestError, match="at most 64 resource lines, not 65") as info:
            parse_request("t", ["nvme"] * 65)
        assert info.value.field == "resources"
        with pytest.raises(InvalidRequestError, match="at most 64 resource lines") as info:
            request_from_document({"name": "t", "resource": [{"kind": "nvme"}] * 65})
        assert info.value.field == "resources"

    def test_selectors(self) -> None:
        many = " ".join(f"k{n}=1" for n in range(33))
        assert len(parse_resource("gpu " + many.rsplit(" ", 1)[0]).selectors) == 32
        with pytest.raises(InvalidRequestError, match="at most 32 selectors, not 33") as info:
            parse_request("t", ["gpu " + many])
        assert info.value.field == "clauses[0]"
        with pytest.raises(InvalidRequestError, match="at most 32 selectors, not 33") as info:
            parse_request("t", ["host " + many, "gpu"])
        assert info.value.field == "clauses[0]"
        with pytest.raises(InvalidRequestError, match="at most 32 selectors") as info:
            request_from_document({"name": "t", "resource": [{"kind": "gpu", "selectors": many.split()}]})
        assert info.value.field == "resource[0]"

    def test_key(self) -> None:
        assert parse_selector("k" * 63 + "=1").key == "k" * 63
        with pytest.raises(InvalidRequestError, match="at most 63 characters") as info:
            parse_request("t", ["gpu " + "k" * 64 + "=1"])
        assert info.value.field == "clauses[0]"
        with pytest.raises(InvalidRequestError, match="at most 63 characters") as info:
            parse_request("t", ["host " + "k" * 64 + "=1", "gpu"])
        assert info.value.field == "clauses[0]"


_WORDS = st.sampled_from(
    (
        *("host", "gpu", "cxl-memory", "x8", "512GiB", "cores>=", "memory>=", "model=", "latency<=", "spread="),
        *("same-switch", "=", "<", ">", "!", "'", '"', ";", " ", "\\", "1e400", "nan", "-1", "0x10", "9" * 30),
        *("\x00", "\udcff", "é"),
    )
)


@settings(max_examples=200)
@given(st.lists(st.lists(st.one_of(_WORDS, st.text(max_size=4)), max_size=8).map("".join), min_size=1, max_size=3))
def test_any_text_is_a_request_or_its_refusal(clauses: list[str]) -> None:
    """Whatever is typed, the request language answers with a request or an `InvalidRequestError`, never another
    exception; a request it makes holds only text the wire can carry."""
    try:
        request = parse_request("t", clauses)
    except InvalidRequestError:
        return
    assert request_limit_refusal(request.resources, request.host) is None
    texts = [request.host.name or ""]
    texts += [s.value for s in request.host.selectors if isinstance(s.value, str)]
    texts += [s.value for line in request.resources for s in line.selectors if isinstance(s.value, str)]
    for text in texts:
        text.encode("utf-8")  # raises on a lone surrogate


class TestDigitsAreAscii:
    """A number is written in the digits 0-9: other scripts' digits (Arabic-Indic, fullwidth) were read as numbers
    by ``\\d`` and ``int``, so ``gpu x`` and an Arabic-Indic three asked for three GPUs, and a request pasted from
    a document with lookalike digits was carried out as another number than the one its reader saw."""

    @pytest.mark.parametrize(
        "text", ["gpu x\u0663", "gpu x\uff13", "cxl-memory \u0668GiB", "gpu x1 gpu_memory>=\u0668\u0660GB"]
    )
    def test_a_line_is_refused(self, text: str) -> None:
        with pytest.raises(InvalidRequestError) as info:
            parse_resource(text)
        assert "\u0663" in info.value.message or "\uff13" in info.value.message or "\u0668" in info.value.message

    def test_a_host_minimum_is_refused(self) -> None:
        with pytest.raises(InvalidRequestError, match="cores"):
            parse_request("j", ["host cores>=\u0663\u0662", "gpu"])

    def test_a_selector_value_in_other_digits_is_refused_unless_quoted(self) -> None:
        with pytest.raises(InvalidRequestError, match="quote it"):
            parse_resource("gpu model=\u0663")
        quoted = parse_resource("gpu model='\"\u0663\"'")
        assert quoted.selectors[0].value == "\u0663"


class TestContradictorySelectors:
    """Selectors on one key that no value can meet together (``model=a model=b``, ``gpu_memory>=80GB
    gpu_memory<40GB``) were taken and then found no fit (NoFitError), which told the user the fabric lacked
    devices; they are refused, naming both. A selector given twice alike asks the same once and is taken."""

    @pytest.mark.parametrize(
        ("clause", "first", "second"),
        [
            ("gpu model=a model=b", "model=a", "model=b"),
            ("gpu x1 gpu_memory>=80GB gpu_memory<40GB", "gpu_memory>=80GB", "gpu_memory<40GB"),
            ("gpu gpu_memory>=80GB gpu_memory<80GB", "gpu_memory>=80GB", "gpu_memory<80GB"),
            ("gpu gpu_memory>80GiB gpu_memory<=80GiB", "gpu_memory>80GiB", "gpu_memory<=80GiB"),
            ("gpu score<=2 score>=3", "score<=2", "score>=3"),
            ("gpu score<1.5 score>1.5", "score<1.5", "score>1.5"),
            ("gpu model=H200 model!=h200", "model=H200", "model!=h200"),
            ("gpu score=4 score>8", "score=4", "score>8"),
            ("gpu rack=r1 rack=1", "rack=r1", "rack=1"),
            ("gpu score>=4 score<=abc", "score>=4", "score<=abc"),
            ("host rack=r1 rack=r2", "rack=r1", "rack=r2"),
            ("host cores>=8 score>=5 score<4", "score>=5", "score<4"),
            ("gpu vendor=acme vendor>zeta", "vendor=acme", "vendor>zeta"),
            ("gpu vendor>=zeta vendor=acme", "vendor>=zeta", "vendor=acme"),
            ("gpu vendor=zz vendor<Z", "vendor=zz", "vendor<Z"),
            ("gpu flag>true", "flag>true", "can never be met"),
            ("gpu name<'\"\"'", 'name<""', "can never be met"),
        ],
    )
    def test_text(self, clause: str, first: str, second: str) -> None:
        with pytest.raises(InvalidRequestError) as info:
            parse_request("t", ["nvme", clause])
        assert info.value.field == "clauses[1]"
        assert first in info.value.message and second in info.value.message

    @pytest.mark.parametrize(
        "clause",
        [
            "gpu model=a model=a",
            "gpu model=H200 model=h200",
            "gpu score>=4 score<=4",
            "gpu score>=4 score<8 score>=6",
            "gpu model!=a model!=b",
            "gpu model=a model!=b",
            "gpu gpu_memory>=80GB gpu_memory<80GiB",
            "gpu rack!=1 rack=r1",
            "host rack=r1 rack=r1",
        ],
    )
    def test_what_can_be_met_is_taken(self, clause: str) -> None:
        parse_request("t", ["nvme", clause])

    def test_documents(self) -> None:
        with pytest.raises(InvalidRequestError, match=r"model=a.*model=b") as info:
            request_from_document({"name": "t", "resource": [{"kind": "gpu", "selectors": ["model=a", "model=b"]}]})
        assert info.value.field == "resource[0].selectors[1]"
        doc = {"name": "t", "host": {"selectors": ["rack>=b", "rack<a"]}, "resource": [{"kind": "gpu"}]}
        with pytest.raises(InvalidRequestError, match=r"rack>=b.*rack<a") as info:
            request_from_document(doc)
        assert info.value.field == "host.selectors[1]"

    def test_one_rule_for_every_path(self) -> None:
        """The wire and the Python client refuse them by the same rule, naming the second selector's field."""
        line = ResourceRequest(
            DeviceKind.GPU, 1, selectors=(Selector("k", SelectorOp.GE, 5), Selector("m", SelectorOp.EQ, "a"))
        )
        assert request_limit_refusal([line]) is None
        line = attrs.evolve(line, selectors=(*line.selectors, Selector("k", SelectorOp.LT, 5)))
        refusal = request_limit_refusal([line])
        assert refusal is not None and refusal[0] == "resources[0].selectors[2]"
        assert "k>=5" in refusal[1] and "k<5" in refusal[1]
        host = HostRequest(selectors=(Selector("rack", SelectorOp.EQ, "r1"), Selector("rack", SelectorOp.NE, "R1")))
        refusal = request_limit_refusal([], host)
        assert refusal is not None and refusal[0] == "host.selectors[1]"


class TestLongTextIsQuotedInPart:
    """A refusal quoted the clause or token it refused whole, so that a token of 5000 characters made a message
    of 5000 (and one, three times over); a refusal quotes the first 64 characters of what the user wrote."""

    @pytest.mark.parametrize(
        "clauses",
        [
            ["gpu model=" + "a" * 5000],
            ["gpu gpu_memory>=" + "9" * 5000],
            ["gpu label=<" + "a" * 5000],
            ["gpu score>=1_" + "0" * 5000],
            ["gpu score>=٣" + "3" * 5000],
            ["gpu model='" + "a" * 5000],
            ["cxl-memory " + "a" * 5000],
            ["cxl-memory 512.0" + "0" * 5000],
            ["gpu spread=" + "-" * 5000],
            ["gpu serial=" + "a" * 5000],
            ["gpu latency<=" + "a" * 5000],
            ["gpu " + "a" * 5000],
            ["host cores=" + "9" * 5000],
            ["host cores>=" + "a" * 5000],
            ["host memory>=" + "a" * 5000],
            ["host h1", "host " + "h" * 5000],
            ["gpu model=a model=" + "b" * 250],
        ],
    )
    def test_text(self, clauses: list[str]) -> None:
        with pytest.raises(InvalidRequestError) as info:
            parse_request("t", [*clauses, "nvme"])
        assert len(info.value.message) < 600, info.value.message

    @pytest.mark.parametrize(
        "doc",
        [
            {"name": "n" * 5000, "resource": [{"kind": "gpu"}]},
            {"name": "t", "resource": [{"kind": "g" * 5000}]},
            {"name": "t", "resource": [{"kind": "gpu", "affinity": "a" * 5000}]},
            {"name": "t", "resource": [{"kind": "gpu", "max_latency": "a" * 5000}]},
            {"name": "t", "resource": [{"kind": "cxl-memory", "amount": "a" * 5000}]},
            {"name": "t", "resource": [{"kind": "gpu", "spread": "-" * 5000}]},
            {"name": "t", "host": {"name": "h" * 5000}, "resource": [{"kind": "gpu"}]},
            {"name": "t", "host": {"min_memory": "a" * 5000}, "resource": [{"kind": "gpu"}]},
        ],
    )
    def test_documents(self, doc: dict[str, Any]) -> None:
        with pytest.raises(InvalidRequestError) as info:
            request_from_document(doc)
        assert len(info.value.message) < 600, info.value.message


class TestAnAmountTooLarge:
    """An amount of thousands of digits was refused as "neither a count nor an amount", though it is an amount,
    too large; it is refused as too large, naming the most a request may give."""

    @pytest.mark.parametrize("digits", [21, 4000, 5000])
    def test_text(self, digits: int) -> None:
        with pytest.raises(InvalidRequestError, match=r"more than the most a request may give, 18446744073709551615"):
            parse_request("t", ["cxl-memory " + "9" * digits + "GiB"])

    def test_document(self) -> None:
        with pytest.raises(InvalidRequestError, match=r"5,000 digits.*18446744073709551615") as info:
            request_from_document({"name": "t", "resource": [{"kind": "cxl-memory", "amount": "9" * 5000 + "GiB"}]})
        assert info.value.field == "resource[0].amount"

    def test_at_the_bound(self) -> None:
        assert parse_resource(f"cxl-memory {2**64 - 1}B").amount_bytes == 2**64 - 1
        with pytest.raises(InvalidRequestError, match="18446744073709551615"):
            parse_resource(f"cxl-memory {2**64}B")


class TestSelectorsNoValueMeets:
    """Only pairs of selectors on one key were judged, so that three that no value meets together (``score>=1
    score<=1 score!=1``) were taken and found no fit, and a pair that a value does meet (``score>=1 score!=1``)
    was refused; and a text ``=`` was never held to a text range (``vendor=acme vendor>zeta``). The values every
    selector of a key admits are worked out whole, and the fewest selectors that leave none are named."""

    @pytest.mark.parametrize(
        ("clause", "named", "left_out"),
        [
            ("gpu model>=1 model<=1 model!=1", ["model>=1", "model<=1", "model!=1"], []),
            ("gpu score>1 score<=5 score>=5 score!=5.0", ["score<=5", "score>=5", "score!=5.0"], ["score>1"]),
            ("gpu flag>=false flag!=false flag!=true", ["flag>=false", "flag!=false", "flag!=true"], []),
            ("gpu model=ab model>aZ model<aa", ["model=ab", "model>aZ", "model<aa"], []),
            ("host rack>=r1 rack<=r1 rack!=R1", ["rack>=r1", "rack<=r1", "rack!=R1"], []),
        ],
    )
    def test_text(self, clause: str, named: list[str], left_out: list[str]) -> None:
        with pytest.raises(InvalidRequestError) as info:
            parse_request("t", ["nvme", clause])
        assert info.value.field == "clauses[1]"
        assert all(repr(sel) in info.value.message for sel in named), info.value.message
        assert not any(repr(sel) in info.value.message for sel in left_out), info.value.message

    @pytest.mark.parametrize(
        "clause",
        [
            "gpu score>=1 score!=1",
            "gpu score<=1 score!=1",
            "gpu score>=1 score<=2 score!=1 score!=2",
            "gpu score>=1 score<=1 score!=2",
            "gpu flag>=false flag!=false",
            "gpu model!=a model!=b model!=c",
            "gpu model>=a model<=a model!=b",
            "gpu vendor=Zeta vendor<zeta",
            "gpu vendor=zeta vendor>=ZETA vendor<=zeta",
            "gpu vendor=k vendor>z",  # KELVIN SIGN, U+212A, is a k to = and above z in order
            "gpu name=\u03b1\u03c2 name>=\u0391\u03a3 name<=\u0391\u03a3",  # ΑΣ lowers to ας, a final sigma
            "gpu name=i\u0307 name>=\u0130 name<=\u0130",  # İ lowers to two characters, i and a dot above
            "gpu vendor=acme vendor!=2 vendor!=true",
        ],
    )
    def test_what_a_value_meets_is_taken(self, clause: str) -> None:
        parse_request("t", [clause])

    def test_the_spellings_are_every_code_points(self) -> None:
        """The table of what lowers to what, built a block of code points at a time, holds what a walk of every
        code point finds (one missed spelling could refuse a request a device meets)."""
        every: dict[str, list[str]] = {"\u03c2": ["\u03a3"]}
        for point in range(sys.maxunicode + 1):
            if chr(point).lower() != chr(point):
                every.setdefault(chr(point).lower(), []).append(chr(point))
        assert textcase._spellings() == {lowered: tuple(chars) for lowered, chars in every.items()}

    VALUES = st.sampled_from([0, 1, 2, 1.5, 1.0, False, True, "", "a", "A", "b", "ab", "aB", "k", "z", "\u212a"])
    WITNESSES = (0, 0.5, 1, 1.25, 1.5, 1.75, 2, 2.5, -1, False, True, "", "a", "A", "aa", "aZ", "ab", "Ab", "AB")

    @given(st.lists(st.tuples(st.sampled_from(list(SelectorOp)), VALUES), min_size=1, max_size=5))
    @settings(max_examples=400, deadline=None)
    def test_never_refuses_what_a_value_meets(self, tests: list[tuple[SelectorOp, Any]]) -> None:
        """Selectors that some value meets (as `Selector.matches` compares, the device without the attribute
        too) are never refused: the rule is sound."""
        selectors = [Selector("k", op, value) for op, value in tests]
        witnesses = (None, *self.WITNESSES, "B", "K", "\u212a", "b", "ba", "zz")
        if any(all(sel.matches(value) for sel in selectors) for value in witnesses):
            assert selectors_conflict(selectors) is None

    def test_documents(self) -> None:
        doc = {"name": "t", "resource": [{"kind": "gpu", "selectors": ["k>=1", "m=a", "k<=1", "k!=1"]}]}
        with pytest.raises(InvalidRequestError, match=r"'k>=1', 'k<=1' and 'k!=1'") as info:
            request_from_document(doc)
        assert info.value.field == "resource[0].selectors[3]"

    def test_one_rule_for_every_path(self) -> None:
        line = ResourceRequest(
            DeviceKind.GPU,
            1,
            selectors=(
                Selector("k", SelectorOp.GE, 1),
                Selector("k", SelectorOp.LE, 1),
                Selector("k", SelectorOp.NE, 1),
            ),
        )
        refusal = request_limit_refusal([line])
        assert refusal is not None and refusal[0] == "resources[0].selectors[2]"
        assert all(text in refusal[1] for text in ("k>=1", "k<=1", "k!=1"))
        host = HostRequest(selectors=(Selector("v", SelectorOp.EQ, "acme"), Selector("v", SelectorOp.GT, "zeta")))
        refusal = request_limit_refusal([], host)
        assert refusal is not None and refusal[0] == "host.selectors[1]"


class TestASelectorNumberOfThousandsOfDigits:
    """A selector's whole number or size of thousands of digits was refused as longer than any number needs,
    where one of thirty digits, or an amount of thousands, names the bound; it names the bound too."""

    INT64 = r"-9223372036854775808 to 9223372036854775807"

    @pytest.mark.parametrize(
        "clause",
        [
            "gpu gpu_memory>=" + "9" * 5000 + "GB",
            "gpu gpu_memory<" + "9" * 5000 + ".5GiB",
            "gpu score>=" + "9" * 5000,
            "gpu score<=-" + "9" * 5000,
            "host rack=" + "9" * 5000,
        ],
    )
    def test_text(self, clause: str) -> None:
        with pytest.raises(InvalidRequestError, match=r"5,000 digits is beyond .*" + self.INT64) as info:
            parse_request("t", [clause, "nvme"])
        assert info.value.field == "clauses[0]"

    def test_document(self) -> None:
        doc = {"name": "t", "resource": [{"kind": "gpu", "selectors": ["gpu_memory>=" + "9" * 5000 + "GiB"]}]}
        with pytest.raises(InvalidRequestError, match=self.INT64) as info:
            request_from_document(doc)
        assert info.value.field == "resource[0].selectors[0]"

    @pytest.mark.parametrize(
        ("clause", "bound"),
        [("host memory>=" + "9" * 5000 + "GiB", "18446744073709551615"), ("host cores>=" + "9" * 5000, "4294967295")],
    )
    def test_a_host_minimum_names_its_bound(self, clause: str, bound: str) -> None:
        with pytest.raises(
            InvalidRequestError, match=r"5,000 digits is more than the most a request may give, " + bound
        ):
            parse_request("t", [clause, "nvme"])

    def test_a_document_min_memory_names_its_bound(self) -> None:
        doc = {"name": "t", "host": {"min_memory": "9" * 5000 + "GiB"}, "resource": [{"kind": "gpu"}]}
        with pytest.raises(InvalidRequestError, match=r"5,000 digits.*18446744073709551615") as info:
            request_from_document(doc)
        assert info.value.field == "host.min_memory"
