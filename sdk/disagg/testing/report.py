"""The certification report: each clause PASS, FAIL or NOT TESTED with its reason, and a verdict; written as
JSON (for machines), JUnit XML (for CI systems) and Markdown (for people)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from disagg.model import Capabilities
from disagg.testing.clauses import CLAUSES, SUITE_VERSION, Clause

PASS, FAIL, NOT_TESTED = "PASS", "FAIL", "NOT TESTED"
CERTIFIED, FAILED, NOT_CERTIFIED = "CERTIFIED", "FAILED", "NOT CERTIFIED"
LISTED_BUT_PASSED = "passed, but the clause is listed as an expected failure: remove it from the expected-failures file"
FILES = ("certification.json", "certification.xml", "certification.md")


@attrs.frozen
class TestOutcome:
    """One test of a clause: ``passed``, ``failed``, ``skipped`` or ``xfailed`` (an expected failure)."""

    test: str
    outcome: str
    message: str = ""


@attrs.frozen
class ClauseResult:
    clause: Clause
    status: str
    reason: str = ""
    expected_failure: bool = False
    tests: tuple[TestOutcome, ...] = ()

    @classmethod
    def of(cls, clause: Clause, tests: Sequence[TestOutcome], expected: bool) -> ClauseResult:
        """FAIL when a test failed (or failed as expected); PASS when none failed and one passed (the reason
        names the tests of it that did not apply); NOT TESTED when none ran. A clause listed as an expected
        failure fails as expected when one of its tests did; when none did but one passed, it FAILs the run, so
        that the list cannot go stale."""
        failed = [t for t in tests if t.outcome in ("failed", "xfailed")]
        if expected and not failed and any(t.outcome == "passed" for t in tests):
            return cls(clause, FAIL, LISTED_BUT_PASSED, False, tuple(tests))
        if failed:
            return cls(
                clause, FAIL, failed[0].message, expected and all(t.outcome == "xfailed" for t in failed), tuple(tests)
            )
        if any(t.outcome == "passed" for t in tests):
            partly = [f"{t.test}: {t.message}" for t in tests if t.outcome == "skipped"]
            return cls(clause, PASS, "; ".join(partly), False, tuple(tests))
        skipped = [t.message for t in tests if t.outcome == "skipped"]
        return cls(clause, NOT_TESTED, skipped[0] if skipped else "no test of this clause ran", False, tuple(tests))


@attrs.frozen
class Subject:
    """What was certified."""

    driver: str = ""
    version: str = ""
    plugin: str = ""
    distribution: str = ""
    fabric: str = ""
    mode: str = "in-process"
    address: str = ""
    capabilities: Capabilities | None = None


@attrs.frozen
class Report:
    subject: Subject
    clauses: tuple[ClauseResult, ...]
    expected_failures: tuple[str, ...] = ()
    started: str = ""
    duration_s: float = 0.0
    suite_version: str = SUITE_VERSION
    incomplete: str = ""
    """Why the run did not finish (interrupted, an internal error), or empty: an unfinished run certifies
    nothing, since the clauses it did not reach were not tested and its clean-up may not have run."""

    @property
    def verdict(self) -> str:
        """FAILED on an unexpected failure; NOT CERTIFIED while expected failures are listed or when the run
        did not finish; else CERTIFIED."""
        if any(c.status == FAIL and not c.expected_failure for c in self.clauses):
            return FAILED
        if self.expected_failures or self.incomplete:
            return NOT_CERTIFIED
        return CERTIFIED

    def to_json(self) -> dict[str, Any]:
        caps = self.subject.capabilities
        return {
            "suite": "disagg driver conformance",
            "suite_version": self.suite_version,
            "driver": {
                "name": self.subject.driver,
                "version": self.subject.version,
                "plugin": self.subject.plugin,
                "distribution": self.subject.distribution,
            },
            "fabric": self.subject.fabric,
            "mode": self.subject.mode,
            "address": self.subject.address,
            "capabilities": None
            if caps is None
            else {
                "kinds": sorted(k.value for k in caps.kinds),
                "features": sorted(f.value for f in caps.features),
                "event_latency_s": caps.event_latency_s,
            },
            "started": self.started,
            "duration_s": round(self.duration_s, 3),
            "expected_failures": list(self.expected_failures),
            "clauses": [
                {
                    "id": c.clause.id,
                    "statement": c.clause.statement,
                    "status": c.status,
                    "reason": c.reason,
                    "expected_failure": c.expected_failure,
                    "tests": [attrs.asdict(t) for t in c.tests],
                }
                for c in self.clauses
            ],
            "counts": {s: sum(c.status == s for c in self.clauses) for s in (PASS, FAIL, NOT_TESTED)},
            "incomplete": self.incomplete,
            "verdict": self.verdict,
        }

    def write(self, out: Path) -> list[Path]:
        """Write the three report files into ``out`` (created); returns their paths."""
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / name for name in FILES]
        paths[0].write_text(json.dumps(self.to_json(), indent=2) + "\n")
        paths[1].write_bytes(self.junit())
        paths[2].write_text(self.markdown())
        return paths

    def withheld(self) -> str:
        """Why a run is not certified though no clause failed (it did not finish, or expected failures are listed
        that did not fail), or empty: a CI that reads only the JUnit report must not see such a run green."""
        if self.incomplete:
            return self.incomplete
        if self.verdict != CERTIFIED and not any(c.status == FAIL for c in self.clauses):
            return f"{self.verdict}: the expected-failures file lists {', '.join(self.expected_failures)}"
        return ""

    def junit(self) -> bytes:
        """One test case a clause, and one more, ``certification``, in error when the verdict is `withheld`."""
        counts = self.to_json()["counts"]
        withheld = self.withheld()
        suites = ET.Element("testsuites")
        suite = ET.SubElement(
            suites,
            "testsuite",
            name="disagg-conformance",
            tests=str(len(self.clauses) + bool(withheld)),
            failures=str(counts[FAIL]),
            skipped=str(counts[NOT_TESTED]),
            errors=str(int(bool(withheld))),
            time=f"{self.duration_s:.3f}",
            timestamp=self.started,
        )
        props = ET.SubElement(suite, "properties")
        for name, value in (
            ("suite_version", self.suite_version),
            ("driver", self.subject.driver),
            ("driver_version", self.subject.version),
            ("fabric", self.subject.fabric),
            ("mode", self.subject.mode),
            ("verdict", self.verdict),
        ):
            ET.SubElement(props, "property", name=name, value=value)
        for c in self.clauses:
            case = ET.SubElement(
                suite, "testcase", classname=f"disagg.conformance.{self.subject.driver}", name=c.clause.id
            )
            if c.status == FAIL:
                kind = "expected failure" if c.expected_failure else "failure"
                failure = ET.SubElement(case, "failure", message=c.reason, type=kind)
                failure.text = "\n".join(f"{t.test}: {t.outcome}: {t.message}" for t in c.tests if t.message)
            elif c.status == NOT_TESTED:
                ET.SubElement(case, "skipped", message=c.reason)
            ET.SubElement(case, "system-out").text = c.clause.statement
        if withheld:
            case = ET.SubElement(
                suite, "testcase", classname=f"disagg.conformance.{self.subject.driver}", name="certification"
            )
            ET.SubElement(case, "error", message=withheld, type=self.verdict)
        data: bytes = ET.tostring(suites, encoding="utf-8", xml_declaration=True)
        return data

    def markdown(self) -> str:
        s = self.subject
        caps = s.capabilities
        lines = [
            f"# Certification of the `{s.driver or s.fabric}` driver: {self.verdict}",
            "",
            "| | |",
            "|---|---|",
            f"| Suite | disagg driver conformance {self.suite_version} |",
            f"| Driver | {s.driver} {s.version} ({s.distribution or s.plugin}) |",
            f"| Fabric | {s.fabric} ({s.mode}{', ' + s.address if s.address else ''}) |",
            f"| Capabilities | {caps.describe() if caps is not None else 'unknown'} |",
            f"| Started | {self.started} ({self.duration_s:.1f} s) |",
            f"| Verdict | **{self.verdict}** |",
            "",
        ]
        if self.incomplete:
            lines += [f"The run is not a certification: {self.incomplete}.", ""]
        if self.expected_failures:
            lines += [
                f"Expected failures listed: {', '.join(self.expected_failures)}; certification is withheld "
                "until the list is empty.",
                "",
            ]
        lines += ["| Clause | Status | Statement | Reason |", "|---|---|---|---|"]
        for c in self.clauses:
            status = f"{c.status} (expected)" if c.expected_failure else c.status
            lines.append(f"| {c.clause.id} | {status} | {_cell(c.clause.statement)} | {_cell(c.reason)} |")
        return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())[:400]


def clause_results(
    outcomes: Mapping[str, Sequence[TestOutcome]], expected: Iterable[str], cleanup: ClauseResult
) -> tuple[ClauseResult, ...]:
    """Every clause of the suite, in the order of `CLAUSES`; the clean-up clause comes from the tracker."""
    wanted = set(expected)
    out = []
    for clause_id, clause in CLAUSES.items():
        if clause_id == cleanup.clause.id:
            if clause_id in wanted and cleanup.status == FAIL:
                cleanup = attrs.evolve(cleanup, expected_failure=True)
            elif clause_id in wanted and cleanup.status == PASS:
                cleanup = attrs.evolve(cleanup, status=FAIL, reason=LISTED_BUT_PASSED)
            out.append(cleanup)
        else:
            out.append(ClauseResult.of(clause, outcomes.get(clause_id, ()), clause_id in wanted))
    return tuple(out)
