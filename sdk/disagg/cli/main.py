"""The ``disagg`` command line: tables for people, ``--json`` for scripts.

Exit codes: 0 done; 1 a fabric or driver failed; 2 bad input or configuration; 3 the request does not fit;
4 not found; 5 conflict (name taken, stale etag); 141 the reader of standard output went away.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tomllib
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from disagg import __version__, codec, failpoints
from disagg.cli import bench as bench_cli
from disagg.cli import certify as certify_cli
from disagg.cli import driver as driver_cli
from disagg.cli import newdriver as newdriver_cli
from disagg.cli import render
from disagg.cli import serve as serve_cli
from disagg.cli.backend import REMOTE_COMMANDS, Backend, RemoteBackend, server_address
from disagg.config import build_composer, load_config
from disagg.errors import (
    ConfigError,
    ConflictError,
    DisaggError,
    InvalidRequestError,
    NoFitError,
    NotFoundError,
    outcome_is_unknown,
)
from disagg.model import (
    MAX_RESERVATION_TTL_S,
    ComposeMode,
    CompositionRequest,
    DeviceKind,
    Reservation,
    format_size,
    parse_size,
)
from disagg.plugins import load_plugins
from disagg.requestlang import bare_amount_refusal, parse_request, parse_resource, request_from_document
from disagg.wire.errors import build
from disagg.wire.fabric import check_id

EXIT_CODES: tuple[tuple[type[DisaggError], int], ...] = (
    (InvalidRequestError, 2),
    (NoFitError, 3),
    (NotFoundError, 4),
    (ConflictError, 5),
)


def exit_code(error: DisaggError) -> int:
    for cls, code in EXIT_CODES:
        if isinstance(error, cls):
            return code
    return 1


def _composer(args: argparse.Namespace) -> Backend:
    """The configured composer, or a client of the fabric manager at ``--server`` / ``$DISAGG_SERVER``; use it
    as a context manager, which starts and closes it."""
    address = server_address(args)
    timeout = getattr(args, "timeout", None)
    if address is not None:
        args.remote = True  # for the message of an interrupt
        return RemoteBackend(address) if timeout is None else RemoteBackend(address, timeout_s=timeout)
    if timeout is not None:
        raise InvalidRequestError("--timeout applies with --server only: a local composer has no calls to time")
    config = load_config(args.config)
    if config.ledger == "etcd":
        # A composer here would write the replicas' shared ledger without the lead and its fence, beside theirs.
        raise ConfigError(
            f'{config.source}: [state] ledger = "etcd" is the ledger of `disagg serve` replicas, which elect one '
            "leader to write it: drive them with --server ADDRESS (or DISAGG_SERVER) instead of a local composer",
            field="state.ledger",
        )
    return build_composer(config)


def cmd_plugins(args: argparse.Namespace) -> int:
    plugins = load_plugins()
    if args.json:
        render.emit_json(
            {
                "plugins": list(plugins.plugins),
                "drivers": {
                    n: {"plugin": d.plugin, "capabilities": d.capabilities, "description": d.description}
                    for n, d in plugins.drivers.items()
                },
                "sharing_policies": {
                    n: {"plugin": p.plugin, "description": p.description} for n, p in plugins.sharing_policies.items()
                },
                "blocked": list(plugins.blocked),
                "broken": plugins.broken,
            }
        )
        return 0
    render.table(
        ("PLUGIN", "DISTRIBUTION", "VERSION", "DRIVERS", "POLICIES"),
        [
            [
                p.name,
                p.distribution,
                p.version,
                ",".join(p.drivers) or "-",
                ",".join([*p.policies, *(f"{s} (sharing)" for s in p.sharing_policies)]) or "-",
            ]
            for p in plugins.plugins
        ],
    )
    print()
    render.table(
        ("DRIVER", "PLUGIN", "CAPABILITIES"),
        [
            # A type that declares nothing (the remote driver) leaves it to each instance.
            [n, d.plugin, d.capabilities.describe() if d.capabilities.kinds else "declared by each instance"]
            for n, d in sorted(plugins.drivers.items())
        ],
    )
    if plugins.blocked:
        print(f"\nblocked by DISAGG_DISABLE_PLUGINS: {', '.join(plugins.blocked)}")
    for name, why in sorted(plugins.broken.items()):
        print(f"\nplugin {name} failed to load: {why}")
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    with _composer(args) as composer:
        topologies = composer.topologies()
        kinds, pools = composer.usage()
        if args.json:
            render.emit_json({"fabrics": topologies, "usage": {"kinds": kinds, "pools": pools}})
            return 0
        for topo in topologies:
            print(
                f"fabric {topo.fabric}: {len(topo.hosts)} hosts, {len(topo.switches)} switches, "
                f"{len(topo.devices)} devices, {len(topo.links)} links"
            )
        print("\nhosts")
        hosts = {h.id: h for t in topologies for h in t.hosts}
        owners = _host_owners(composer)
        render.table(
            ("HOST", "CORES", "MEMORY", "COMPOSITION"),
            [
                [h.id, h.cores, format_size(h.memory_bytes), owners.get(h.id, "-")]
                for h in sorted(hosts.values(), key=lambda h: h.id)
            ],
        )
        print("\ndevices and pools")
        render.show_usage(kinds, pools)
        return 0


def _host_owners(composer: Backend) -> dict[str, str]:
    """Host id to the name of the composition on it; one listing, not one per host (a remote call each)."""
    owners: dict[str, str] = {}
    for comp in composer.compositions():
        owners.setdefault(comp.host, comp.name)
    return owners


def _device_kind(text: str) -> DeviceKind:
    """``--kind``: a device kind, or a usage error that lists the known ones."""
    try:
        return DeviceKind.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_devices(args: argparse.Namespace) -> int:
    with _composer(args) as composer:
        devices = [d for d in composer.devices() if args.kind is None or d.kind is args.kind]
        if args.json:
            rows = [
                {**codec.to_public_data(d), "held_by": composer.owner_of(d.id), "cordoned": composer.is_cordoned(d.id)}
                for d in devices
            ]
            render.emit_json(rows)
            return 0
        render.table(
            ("DEVICE", "KIND", "MODEL", "SERIAL", "SWITCH", "HEALTH", "HELD BY", "CORDONED"),
            [
                [
                    d.id,
                    d.kind.value,
                    d.model,
                    d.serial,
                    d.switch,
                    d.health.value,
                    composer.owner_of(d.id) or "-",
                    "yes" if composer.is_cordoned(d.id) else "-",
                ]
                for d in devices
            ],
        )
        return 0


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once: ``json`` lets the last of two silently win, where TOML
    refuses the file."""
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:
            raise ValueError(f"{key!r} is given twice in one object: give it once")
        doc[key] = value
    return doc


def _request(args: argparse.Namespace) -> CompositionRequest:
    if args.file == "":  # most often ``--file "$REQUEST"`` with REQUEST unset: the clauses alone composed
        raise InvalidRequestError(
            "--file is empty: give the request file's path (was it a variable left unset?), or leave --file out and "
            "give the resources as clauses",
            field="file",
        )
    if args.file:
        path = Path(args.file)
        try:
            text = path.read_text(encoding="utf-8")  # as TOML and JSON are, whatever the locale says
            doc = (
                json.loads(text, object_pairs_hook=_once_each)
                if path.suffix.lower() == ".json"
                else tomllib.loads(text)
            )
        except FileNotFoundError:
            raise InvalidRequestError(f"request file {path} does not exist", field="file") from None
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(f"cannot read request file {path}: {exc}", field="file") from exc
        except RecursionError:  # the parsers recurse per level of nesting; a request has a few
            raise InvalidRequestError(
                f"cannot read request file {path}: it is nested too deeply to be a request", field="file"
            ) from None
        if args.clauses:
            raise InvalidRequestError(
                f"--file {path} gives the resources: give no resource clauses with it ({' '.join(args.clauses)})",
                field="clauses",
            )
        if args.name and isinstance(doc, dict):
            doc = {**doc, "name": args.name}
        return request_from_document(doc)
    if not args.name:
        raise InvalidRequestError("give a composition name and its resources, or --file", field="name")
    try:
        return parse_request(args.name, args.clauses)
    except InvalidRequestError as exc:
        hint = _quote_hint(args.clauses, exc.field)
        if not hint:
            raise
        raise InvalidRequestError(f"{exc.message}; {hint}", field=exc.field, metadata=exc.metadata) from None


_CLAUSE_FIELD = re.compile(r"clauses\[(\d+)\]")


def _quote_hint(clauses: Sequence[str], field: str) -> str:
    """How to mend a clause the shell split into words (``compose job gpu x2``): each argument is a clause, so a
    lone word after another is refused as a device kind, which says nothing of the quotes left out. Empty when
    the refused argument is no lone word after another (or ``;`` separates clauses, and so numbers them apart)."""
    found = _CLAUSE_FIELD.fullmatch(field)
    if found is None or any(";" in clause for clause in clauses):
        return ""
    parts = [clause.strip() for clause in clauses if clause.strip()]
    n = int(found.group(1))
    if not 1 <= n < len(parts) or len(parts[n].split()) != 1 or parts[n] == "host":
        return ""
    return f"each clause is one argument: quote it whole, '{parts[n - 1]} {parts[n]}'"


def _check_request_id(args: argparse.Namespace) -> None:
    """Hold ``--request-id`` to the server's rule (1 to 128 printable characters, no spaces) whichever backend
    runs the command, so that an id the one takes the other takes too."""
    if args.request_id is not None:
        check_id(args.request_id, "--request-id")


def _request_id(args: argparse.Namespace) -> str | None:
    """``--request-id``; with ``--server`` and none given, one made here rather than by the client, so that an
    interrupt can name it (see `_interrupted`)."""
    if args.request_id is None and getattr(args, "remote", False):
        args.request_id = uuid.uuid4().hex
    request_id: str | None = args.request_id
    return request_id


DEFAULT_RESERVE_S = 60.0
"""How long ``compose --reserve 0`` holds the plan: the protocol's default, which its 0 stands for."""


def _reserve_s(given: float | None) -> float:
    """``--reserve``, checked here so that the refusal names the flag: the composer's names none, and a server's
    names ``reservation_ttl_s``, a field of the protocol that the command line has not."""
    if not given:
        return DEFAULT_RESERVE_S
    if not 0 < given <= MAX_RESERVATION_TTL_S:  # NaN too: it would never expire
        raise InvalidRequestError(
            f"--reserve {given:g}: the reservation time to live must be above 0 and at most "
            f"{MAX_RESERVATION_TTL_S:g} seconds (0 for the default, {DEFAULT_RESERVE_S:g})",
            field="reserve",
        )
    return given


def cmd_compose(args: argparse.Namespace) -> int:
    request = _request(args)
    reserve_s = _reserve_s(args.reserve)
    _check_request_id(args)
    mode = (
        ComposeMode.PREVIEW if args.preview else ComposeMode.RESERVE if args.reserve is not None else ComposeMode.APPLY
    )
    with _composer(args) as composer:
        request_id = None if mode is ComposeMode.PREVIEW and args.request_id is None else _request_id(args)
        result = composer.compose(request, mode, reservation_ttl_s=reserve_s, request_id=request_id)
        if args.json:
            render.emit_json(result)
            return 0
        if result.composition is not None:
            render.show_composed(result.composition)
            return 0
        held = result.reservation
        if held is None:
            print(f"would compose on host {result.plan.host}")
        else:
            print(f"reserved as {held.id} on host {result.plan.host} until {render.timestamp(held.expires_at)}")
        render.table(
            ("DEVICE / POOL", "LATENCY", "AMOUNT"),
            [[p.device, f"{p.latency_ns} ns", "-"] for p in result.plan.devices]
            + [[m.pool, f"{m.latency_ns} ns", format_size(m.amount_bytes)] for m in result.plan.memory],
        )
        if held is not None:
            print(render.reservation_next_steps(held.id))
        return 0


def cmd_recompose(args: argparse.Namespace) -> int:
    if args.etag == "":  # most often ``--etag "$ETAG"`` with ETAG unset; refused here in the command line's words
        raise InvalidRequestError(
            "--etag is empty: an etag is never empty (was it a variable left unset?); leave --etag out for no guard",
            field="etag",
        )
    # Clauses separated by ";", as compose takes them: one --add may give several.
    clauses = [part.strip() for text in args.add for part in text.split(";") if part.strip()]
    add = [parse_resource(a, field=f"add[{n}]") for n, a in enumerate(clauses)]
    _check_request_id(args)
    with _composer(args) as composer:
        comp = composer.recompose(
            args.composition, add=add, remove=args.remove, expected_etag=args.etag, request_id=_request_id(args)
        )
        if args.json:
            render.emit_json(comp)
        else:
            print(f"recomposed {comp.name} ({comp.id}), now {comp.etag}")
            render.show_composition_devices(comp)
        return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with _composer(args) as composer:
        comps = composer.compositions()
        if args.json:
            render.emit_json(comps)
            return 0
        render.show_compositions(comps)
        # Reservations hold devices and names too; a script lists them with `reservations --json`.
        held = composer.reservations()
        if held:
            print("\nreservations (disagg apply ID composes one, disagg release ID gives one back)")
            render.show_reservations(held)
        return 0


def cmd_decompose(args: argparse.Namespace) -> int:
    with _composer(args) as composer:
        # Every name is looked up before anything is decomposed: a mistyped one refuses the command whole, instead
        # of stopping it midway with the names after it silently not tried.
        found: list[tuple[str, str]] = []
        missing: list[str] = []
        for key in args.compositions:
            try:
                found.append((key, composer.find(key).id))
            except NotFoundError:
                missing.append(key)
        if missing and not args.ignore_missing:
            names = ", ".join(repr(m) for m in missing)
            raise NotFoundError(
                "composition",
                missing[0],
                f"composition {names} not found; nothing was decomposed" + _reserved(composer.reservations(), missing),
            )
        decomposed = []
        for key, comp_id in found:
            composer.decompose(comp_id)
            decomposed.append(key)
            if not args.json:
                print(f"decomposed {key}")
        if args.json:
            print(json.dumps({"decomposed": decomposed}))
        return 0


def _reserved(reservations: Sequence[Reservation], keys: Sequence[str]) -> str:
    """A note on each of ``keys`` that is a reservation's id or the name it holds: `decompose` of one said only
    that no composition had it, and `apply` or `release` of its name that no reservation had it."""
    by_key = {r.request.name: r for r in reservations} | {r.id: r for r in reservations}
    notes = []
    for key in keys:
        held = by_key.get(key)
        if held is not None:
            what = "is a reservation" if key == held.id else f"is reserved as {held.id}"
            notes.append(f"; {key!r} {what}: {render.reservation_next_steps(held.id)}")
    return "".join(notes)


def cmd_reservations(args: argparse.Namespace) -> int:
    with _composer(args) as composer:
        held = composer.reservations()
        if args.json:
            render.emit_json(held)
        else:
            render.show_reservations(held)
        return 0


def cmd_apply(args: argparse.Namespace) -> int:
    _check_request_id(args)
    with _composer(args) as composer:
        try:
            comp = composer.apply_reservation(args.reservation, request_id=_request_id(args))
        except NotFoundError as exc:
            raise _naming_the_reservation(exc, args.reservation, composer) from None
        if args.json:
            render.emit_json(comp)
        else:
            render.show_composed(comp)
        return 0


def _naming_the_reservation(error: NotFoundError, key: str, composer: Backend) -> DisaggError:
    """``error``, no reservation found for ``key``, saying which reservation holds ``key`` as its name: `apply
    NAME` said only that the reservation expired, was released or never existed, while `decompose NAME` named it."""
    note = _reserved(composer.reservations(), [key])
    if not note:
        return error
    return build(type(error), error.message + note, metadata=error.metadata, resource=(error.resource_type, error.name))


def cmd_release(args: argparse.Namespace) -> int:
    with _composer(args) as composer:
        # Every id is looked up before anything is released, as `decompose` does: releasing is idempotent, and an
        # unknown id would otherwise pass for one released.
        reservations = composer.reservations()
        held = {r.id for r in reservations}
        missing = [key for key in args.reservations if key not in held]
        if missing and not args.ignore_missing:
            names = ", ".join(repr(m) for m in missing)
            raise NotFoundError(
                "reservation",
                missing[0],
                f"reservation {names} not found (it expired, was applied or released, or never existed); nothing "
                "was released" + _reserved(reservations, missing),
            )
        released = []
        for key in dict.fromkeys(args.reservations):  # each once: a second release of one released nothing
            if key in held:
                composer.release_reservation(key)
                released.append(key)
                if not args.json:
                    print(f"released {key}")
        if args.json:
            print(json.dumps({"released": released}))
        return 0


def cmd_cordon(args: argparse.Namespace) -> int:
    return _cordons(args, cordon=True)


def cmd_uncordon(args: argparse.Namespace) -> int:
    return _cordons(args, cordon=False)


def _cordons(args: argparse.Namespace, *, cordon: bool) -> int:
    """``cordon`` or ``uncordon`` each device given (the composer's, idempotent: one cordoned already is fine);
    ``uncordon`` lifts a quarantine too, as the `BindingQuarantined` event tells the operator to."""
    verb = "cordoned" if cordon else "uncordoned"
    with _composer(args) as composer:
        # Every id is looked up before any device is changed, as `decompose` and `release` do: a mistyped id refuses
        # the command whole, instead of stopping it midway with the ids after it silently not tried. One listing,
        # not one call per id; and an id that cannot be one ("a b") is not found with --server as locally, instead of
        # refused by the server as bad input (exit 2).
        known = {d.id for d in composer.devices()}
        missing = [key for key in dict.fromkeys(args.devices) if key not in known]
        if missing:
            names = ", ".join(repr(m) for m in missing)
            raise NotFoundError("device", missing[0], f"device {names} not found; nothing was {verb}")
        change = composer.cordon if cordon else composer.uncordon
        changed = []
        for key in dict.fromkeys(args.devices):  # each once: the second would change nothing
            change(key)
            changed.append(key)
            if not args.json:
                print(f"{verb} {key}")
        if args.json:
            print(json.dumps({verb: changed}))
        return 0


def _memory(text: str) -> str:
    """``--memory``: a size with its unit (``256MiB``), kept as written; anything else is refused, a count
    (``x8``, ``8``) included: on the resource line it becomes, that asks for whole memory devices. So is a
    number with a point and no unit (``512.0``), which was taken as bytes."""
    why = bare_amount_refusal(text)
    if why:
        raise InvalidRequestError(f"--memory {why}", field="memory")
    try:
        if not text.strip().isdigit() and parse_size(text) > 0:
            return text
    except ValueError:
        pass
    raise InvalidRequestError(
        f"--memory {text!r} is not a size of memory (write it with its unit, e.g. 256MiB)", field="memory"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    if args.fabric:
        from disagg.cli.demo_driver import DEFAULT_MEMORY, run_driver_demo

        config = load_config(args.config) if args.config is not None else None
        memory = DEFAULT_MEMORY if args.memory is None else _memory(args.memory)
        return run_driver_demo(args.fabric, config=config, memory=memory, keep=args.keep, json_output=args.json)
    if args.memory is not None or args.keep:
        raise InvalidRequestError("--memory and --keep apply with --fabric only", field="fabric")
    from disagg.cli.demo import run_demo

    return run_demo(json_output=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disagg", description="Compose systems from pooled GPUs, CXL memory and more."
    )
    parser.add_argument("--version", action="version", version=f"disagg {__version__}")
    server_help = "drive the fabric manager at ADDRESS (unix:/path or host:port) instead of a local composer"
    parser.add_argument("--server", metavar="ADDRESS", help=server_help + " (default: $DISAGG_SERVER)")
    timeout_help = "with --server, each call's deadline in seconds, retries included (default 30)"
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help=timeout_help)
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--server", metavar="ADDRESS", default=argparse.SUPPRESS, help=server_help)
    remote.add_argument("--timeout", type=float, metavar="SECONDS", default=argparse.SUPPRESS, help=timeout_help)
    config_help = "configuration file (default: $DISAGG_CONFIG, ./disagg.toml, built-in demo rack)"
    parser.add_argument("--config", help=config_help)  # before the command too, as --server is
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS, help=config_help)
    common.add_argument("--json", action="store_true", help="print JSON for scripts")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        parents = [common, remote] if name in REMOTE_COMMANDS else [common]
        p = sub.add_parser(name, parents=parents, help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    p = add("demo", cmd_demo, "compose, fail, heal, recompose and decompose on the simulated demo rack")
    p.add_argument(
        "--fabric",
        metavar="DRIVER",
        help="instead: compose from one driver's fabric (the one --config gives it, else its certification "
        "fabric) and show what the driver reports",
    )
    p.add_argument("--memory", help="with --fabric: the CXL memory to compose, a size (default 256MiB)")
    p.add_argument(
        "--keep", action="store_true", help="with --fabric: leave the composition on the hardware, to look at"
    )
    add("plugins", cmd_plugins, "list plugins, their versions, drivers and capabilities")
    add("topology", cmd_topology, "show the fabrics, hosts, devices and pools")
    p = add("devices", cmd_devices, "list devices with their health and holder")
    p.add_argument(
        "--kind", type=_device_kind, help="only devices of this kind (gpu, cxl-memory, nvme, nic, fpga, dpu)"
    )
    add("ls", cmd_ls, "list compositions")
    p = add("compose", cmd_compose, "compose a system: NAME then clauses such as 'gpu x8 model=H200 same-switch'")
    p.add_argument("name", nargs="?", help="composition name")
    p.add_argument("clauses", nargs="*", help="'host ...' and resource clauses (see docs/request-language.md)")
    p.add_argument("--file", help="a request document (TOML or .json) instead of clauses")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--preview", action="store_true", help="show the plan, change nothing")
    group.add_argument("--reserve", type=float, metavar="SECONDS", help="hold the plan for SECONDS")
    p.add_argument("--request-id", metavar="ID", help=REQUEST_ID_HELP)
    p = add("recompose", cmd_recompose, "add resources to or remove devices from a composition")
    p.add_argument("composition", help="composition name or id")
    p.add_argument("--add", action="append", default=[], help="resource clauses to add, separated by ';' (repeatable)")
    p.add_argument("--remove", action="append", default=[], help="a device or allocation id to remove (repeatable)")
    p.add_argument("--etag", help="refuse unless the composition is still at this etag")
    p.add_argument("--request-id", metavar="ID", help=REQUEST_ID_HELP)
    p = add("decompose", cmd_decompose, "release compositions by name or id")
    p.add_argument("compositions", nargs="+")
    p.add_argument("--ignore-missing", action="store_true", help="an unknown composition is not an error")
    add("reservations", cmd_reservations, "list the plans held by compose --reserve")
    p = add("apply", cmd_apply, "compose a reservation's plan (made by compose --reserve)")
    p.add_argument("reservation", metavar="RESERVATION", help="reservation id (r-...)")
    p.add_argument("--request-id", metavar="ID", help=REQUEST_ID_HELP)
    p = add("release", cmd_release, "give reservations' devices and names back")
    p.add_argument("reservations", nargs="+", metavar="RESERVATION", help="reservation id (r-...)")
    p.add_argument("--ignore-missing", action="store_true", help="an unknown reservation is not an error")
    p = add("cordon", cmd_cordon, "keep devices out of placement (a composition that holds one keeps it)")
    p.add_argument("devices", nargs="+", metavar="DEVICE", help="device id (as devices lists it)")
    p = add("uncordon", cmd_uncordon, "offer cordoned devices to placement again, lifting a quarantine")
    p.add_argument("devices", nargs="+", metavar="DEVICE", help="device id (as devices lists it)")
    serve_cli.register(add)
    driver_cli.register(sub)
    certify_cli.register(sub)
    newdriver_cli.register(sub)
    bench_cli.register(sub)
    return parser


REQUEST_ID_HELP = (
    "make the change once under this id: the same command again gets the first answer and changes nothing "
    "(an error whose outcome is unknown names the id to use)"
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.server is not None and args.command not in REMOTE_COMMANDS:
        parser.error(f"--server does not apply to {args.command}, which runs locally")
    if args.timeout is not None and args.command not in REMOTE_COMMANDS:
        parser.error(f"--timeout does not apply to {args.command}, which makes no calls to a fabric manager")
    if args.command == "recompose" and not args.add and not args.remove:
        parser.error("recompose: give at least one --add CLAUSE or --remove ID")
    try:
        code = _run(args)
        sys.stdout.flush()  # here, and not at exit, where a reader gone away could only be reported as a traceback
    except BrokenPipeError:
        return _reader_gone()
    return code


READER_GONE = 141
"""The exit code when standard output's reader went away (``disagg devices | head -1``): what a shell reports
for a command ended by SIGPIPE, as Unix tools are."""


def _reader_gone() -> int:
    """Stop quietly, as a Unix tool ended by SIGPIPE does; standard output now goes to /dev/null, so that the
    flush at exit of what is left in its buffer cannot fail again."""
    with contextlib.suppress(OSError, ValueError):  # a standard output that is not a file has no descriptor
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return READER_GONE


def _run(args: argparse.Namespace) -> int:
    """The command, with its errors and an interrupt turned into their messages and exit codes. A bad
    ``$DISAGG_FAILPOINTS`` stops every command, not only ``serve``: a local compose runs the composer's failpoints
    too, and one misspelt would let a crash test pass without a crash."""
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        failpoints.check()
        return func(args)
    except DisaggError as exc:
        print(f"disagg: error: {exc.message}", file=sys.stderr)
        request_id = exc.metadata.get("request_id")
        if request_id and outcome_is_unknown(exc):
            print(
                f"disagg: the change may have been made: run the same command with --request-id {request_id} to "
                "get its outcome (it is not made twice)",
                file=sys.stderr,
            )
        return exit_code(exc)
    except KeyboardInterrupt:
        print(_interrupted(args), file=sys.stderr)
        return 130


CHANGES = frozenset({"compose", "recompose", "decompose", "apply"})
"""The commands that change compositions: an interrupt may leave one half made. (``release`` changes
reservations, each at once and whole: an interrupt leaves some released, which `_interrupted` says; so do
``cordon`` and ``uncordon``, of devices.)"""


def _interrupted(args: argparse.Namespace) -> str:
    """What an interrupt (Ctrl-C) stopped and what becomes of it: a local change is left COMPOSING or
    DECOMPOSING in the ledger, and the next command to open it (or ``disagg serve``) finishes or undoes it; a
    remote one goes on at the server, and the same command with its request id gets the outcome."""
    subject = next(
        (
            value
            for key in ("name", "composition", "compositions", "reservation", "reservations", "devices")
            if (value := getattr(args, key, None))
        ),
        None,
    )
    what = f"disagg: interrupted: {args.command}"
    if subject:
        what += " " + (subject if isinstance(subject, str) else " ".join(subject))
    if args.command == "release":
        given = "some may be given back already" if args.json else "those printed as released are given back"
        return (
            f"{what}: {given}, and the others may be too; run the same command with --ignore-missing to release the "
            "rest (releasing is idempotent), or reservations to see what is held"
        )
    if args.command in ("cordon", "uncordon"):
        verb = f"{args.command}ed"
        given = f"some may be {verb} already" if args.json else f"those printed as {verb} are"
        return (
            f"{what}: {given}, and the others may be too; run the same command again to {args.command} the rest "
            f"({args.command}ing is idempotent), or devices to see which are cordoned"
        )
    if args.command not in CHANGES or getattr(args, "preview", False):
        return f"{what} (it changes nothing)" if args.command in CHANGES else what
    if getattr(args, "remote", False):
        request_id = getattr(args, "request_id", None)
        if request_id:
            return (
                f"{what}: the fabric manager may still make the change; run the same command with --request-id "
                f"{request_id} to get its outcome (it is not made twice)"
            )
        return f"{what}: the fabric manager may still make the change; run ls to see where it stands"
    return (
        f"{what}: the change may be half made; the next disagg command on this ledger (or disagg serve) finishes "
        "or undoes it, and ls then shows the outcome"
    )


if __name__ == "__main__":
    from disagg.cli.entry import finished

    sys.exit(finished(main()))
