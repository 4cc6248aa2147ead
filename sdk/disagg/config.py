"""Configuration: ``disagg.toml`` names the fabrics to load, the ledger and the listeners.

Found at ``--config``, else ``$DISAGG_CONFIG``, else ``./disagg.toml``; with none, the embedded default (the
simulated demo rack) is used. ``{state_dir}`` in a string is replaced by ``$DISAGG_STATE_DIR`` or the XDG
state directory (``~/.local/state/disagg``). ``[state] path`` is read from the file's directory when relative,
with ``~`` expanded.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from disagg.errors import ConfigError, PluginError
from disagg.model import fabric_name_refusal
from disagg.model.devices import MAX_FABRIC_NAME

if TYPE_CHECKING:
    from disagg.composer import FabricComposer
    from disagg.plugins import Plugins

CONFIG_ENV = "DISAGG_CONFIG"
STATE_DIR_ENV = "DISAGG_STATE_DIR"
LEDGERS = ("sqlite", "memory", "etcd")
STATE_OPTIONS = ("state_file", "state_dir")
"""The driver options that name where a fabric keeps its own state (the sim's file, the qemu-cxl and cxl-switch
drivers' directory): no two fabrics may name the same one."""
MAX_CALL_TIMEOUT_S = 86_400.0
"""The longest ``call_timeout_s``: a day. A change that waits on a busy composition waits on threading primitives,
which overflow beyond `threading.TIMEOUT_MAX`; no driver call needs longer."""
LEDGER_KEYS = {
    "path": ("sqlite", "memory"),
    "endpoints": ("etcd",),
    "prefix": ("etcd",),
    "lease_ttl_s": ("etcd",),
    "epoch_base": ("etcd",),
}
"""The ``[state]`` keys that only some ledgers read. One given to another is refused: an operator who leaves out
``ledger = "etcd"`` beside ``endpoints`` would otherwise run each replica on a private SQLite ledger. ``path``
is let be with ``memory``, which a document may switch to without dropping it (``bench/compose_loop.py``)."""


@attrs.frozen
class FabricConfig:
    name: str
    driver: str
    options: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Config:
    fabrics: tuple[FabricConfig, ...]
    ledger: str = "sqlite"
    ledger_path: str = ""
    etcd_endpoints: tuple[str, ...] = ()
    """With ``ledger = "etcd"``: the cluster's client endpoints (HOST:PORT); replicas on it elect a leader."""
    etcd_prefix: str = "/disagg/"
    lease_ttl_s: int = 3
    epoch_base: int = 0
    """With ``ledger = "etcd"``: the least base of the fencing epoch (see `disagg.ha.election`)."""
    policy: str = "best-fit"
    auto_heal: bool = True
    call_timeout_s: float = 30.0
    listeners: tuple[str, ...] = ()
    source: str = "embedded default"


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$DISAGG_STATE_DIR``, else ``$XDG_STATE_HOME/disagg``, else ``~/.local/state/disagg``; a relative one is
    read from the working directory, now, so that a ``{state_dir}`` path in a file does not move with the file
    (a relative ``[state] path`` is read from the file's directory)."""
    env = os.environ if environ is None else environ
    if env.get(STATE_DIR_ENV):
        return Path(env[STATE_DIR_ENV]).expanduser().absolute()
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return (Path(base) / "disagg").absolute()


def _state_dir_used(environ: Mapping[str, str] | None) -> Path:
    """`state_dir`, as something is put in it: refused when it is there and is not a directory, naming where it
    came from (the ledger and the drivers' state files under it failed with "File exists", naming a path under
    it and not the variable)."""
    sdir = state_dir(environ)
    if sdir.exists() and not sdir.is_dir():
        env = os.environ if environ is None else environ
        origin = next((f"${name}" for name in (STATE_DIR_ENV, "XDG_STATE_HOME") if env.get(name)), "the default")
        raise ConfigError(
            f"{origin}: {sdir} is a file, not a directory: the state directory (the ledger, the drivers' state) "
            "must be a directory, or a path where one can be made",
            field=STATE_DIR_ENV,
        )
    return sdir


_MISSPELT = re.compile(r"\{[^{}]*state[^{}]*\}", flags=re.IGNORECASE)
"""A word in braces that means ``{state_dir}`` but is not it (``{statedir}``, ``{STATE_DIR}``). Other braces
are left alone: a kernel command line may hold them."""


def _expand(value: Any, sdir: Callable[[], Path], source: str) -> Any:
    """``value`` with ``{state_dir}`` replaced, the directory asked for (``sdir``) only where it is used."""
    if isinstance(value, str):
        unknown = _MISSPELT.search(value.replace("{state_dir}", ""))
        if unknown:  # it would make a new, empty ledger in a folder of that name
            raise ConfigError(f"{source}: {value!r}: {unknown.group(0)} is no placeholder (there is {{state_dir}})")
        return value.replace("{state_dir}", str(sdir())) if "{state_dir}" in value else value
    if isinstance(value, Mapping):
        return {k: _expand(v, sdir, source) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, sdir, source) for v in value]
    return value


def _ledger_path(path: str, base: Path | None) -> str:
    """``[state] path`` as the ledger opens it: ``~`` expanded, and a relative path read from ``base`` (the
    file's directory), not from wherever the command runs. SQLite's ``:memory:`` is left for the ledger to
    refuse (`disagg.store.sqlite.MEMORY`)."""
    if path == ":memory:":
        return path
    expanded = Path(path).expanduser()
    return str(expanded if base is None else base / expanded)


def _table(doc: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: [{key}] must be a table", field=key)
    return value


def _known(table: Mapping[str, Any], allowed: set[str], where: str, source: str, path: str = "") -> None:
    """Refuse unknown keys; ``path`` is the dotted prefix of the error's field (``state``, ``fabric[0]``). A key
    that is not text (only a document built in Python has one) is refused first: it cannot be sorted with text."""
    for key in table:
        if not isinstance(key, str):
            field = f"{path}.{key!r}" if path else repr(key)
            raise ConfigError(f"{source}: keys are text; {where} has the key {key!r}", field=field)
    unknown = sorted(set(table) - allowed)
    if unknown:
        field = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(f"{source}: unknown keys in {where}: {', '.join(unknown)}", field=field)


def _check_endpoints(endpoints: list[str], source: str) -> None:
    """Hold each etcd endpoint to HOST:PORT as the file is read, naming the file and the key: the ledger, which
    reads them once ``serve`` builds its election, says neither."""
    from disagg.store.etcd import parse_endpoint

    for endpoint in endpoints:
        try:
            parse_endpoint(endpoint)
        except ConfigError as exc:
            raise ConfigError(f"{source}: [state] endpoints: {exc.message}", field="state.endpoints") from None


def parse_config(
    doc: Mapping[str, Any], source: str, environ: Mapping[str, str] | None = None, *, base: Path | None = None
) -> Config:
    """Validate a parsed TOML document; every error names the file and the key. ``base`` is the directory a
    relative ``[state] path`` is read from: the file's (without it, the working directory)."""
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{source}: a configuration is a table of sections, not {type(doc).__name__}")
    try:
        doc = _expand(doc, lambda: _state_dir_used(environ), source)
    except RecursionError:  # only a document built in Python: TOML this deep is refused as it is read
        raise ConfigError(f"{source}: nested too deeply") from None
    _known(doc, {"state", "composer", "fabric", "listener"}, "the top level", source)
    state = _table(doc, "state", source)
    _known(state, {"ledger", "path", "endpoints", "prefix", "lease_ttl_s", "epoch_base"}, "[state]", source, "state")
    ledger = state.get("ledger", "sqlite")
    if ledger not in LEDGERS:
        raise ConfigError(
            f"{source}: [state] ledger must be one of {', '.join(LEDGERS)}, not {ledger!r}", field="state.ledger"
        )
    for key, ledgers in LEDGER_KEYS.items():
        if key in state and ledger not in ledgers:
            raise ConfigError(
                f'{source}: [state] {key} applies to ledger = "{ledgers[0]}" only, and the ledger is {ledger!r}'
                f'{" (the default)" if "ledger" not in state else ""}: set ledger = "{ledgers[0]}" or remove {key}',
                field=f"state.{key}",
            )
    if "path" in state:
        path = state["path"]
    else:  # the default, checked only where the ledger uses it: the memory and etcd ledgers write no file
        path = str((_state_dir_used(environ) if ledger == "sqlite" else state_dir(environ)) / "ledger.db")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{source}: [state] path must be the ledger file's path, as text", field="state.path")
    if "\0" in path:  # TOML lets a string hold one; no file name can
        raise ConfigError(f"{source}: [state] path must not hold a NUL character", field="state.path")
    try:
        path = _ledger_path(path, base)
    except RuntimeError:  # ~user of no user
        raise ConfigError(f"{source}: [state] path {path!r}: no such home directory", field="state.path") from None
    endpoints = state.get("endpoints", [])
    if not isinstance(endpoints, list) or not all(isinstance(e, str) and e for e in endpoints):
        raise ConfigError(f"{source}: [state] endpoints must be a list of HOST:PORT strings", field="state.endpoints")
    if ledger == "etcd" and not endpoints:
        raise ConfigError(
            f'{source}: [state] ledger = "etcd" needs endpoints = ["HOST:PORT", ...]', field="state.endpoints"
        )
    if ledger == "etcd":
        _check_endpoints(endpoints, source)
    prefix = state.get("prefix", "/disagg/")
    if not isinstance(prefix, str) or not prefix.startswith("/") or not prefix.endswith("/"):
        raise ConfigError(f"{source}: [state] prefix must start and end with '/'", field="state.prefix")
    ttl = state.get("lease_ttl_s", 3)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or not 2 <= ttl <= 60:
        raise ConfigError(
            f"{source}: [state] lease_ttl_s must be a whole number of seconds from 2 to 60", field="state.lease_ttl_s"
        )
    epoch_base = state.get("epoch_base", 0)
    if not isinstance(epoch_base, int) or isinstance(epoch_base, bool) or not 0 <= epoch_base < 2**62:
        raise ConfigError(
            f"{source}: [state] epoch_base must be a whole number from 0 (raise it above the epoch the drivers "
            f"refuse a leader with, after moving to a new etcd cluster), not {epoch_base!r}",
            field="state.epoch_base",
        )
    composer = _table(doc, "composer", source)
    _known(composer, {"policy", "auto_heal", "call_timeout_s"}, "[composer]", source, "composer")
    timeout = composer.get("call_timeout_s", 30.0)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
        raise ConfigError(
            f"{source}: [composer] call_timeout_s must be a positive number", field="composer.call_timeout_s"
        )
    if timeout > MAX_CALL_TIMEOUT_S:
        raise ConfigError(
            f"{source}: [composer] call_timeout_s must be at most {MAX_CALL_TIMEOUT_S:.0f} seconds (a day), "
            f"not {timeout!r}",
            field="composer.call_timeout_s",
        )
    policy = composer.get("policy", "best-fit")
    if not isinstance(policy, str) or not policy:
        raise ConfigError(f"{source}: [composer] policy must be a placement policy's name", field="composer.policy")
    auto_heal = composer.get("auto_heal", True)
    if not isinstance(auto_heal, bool):
        raise ConfigError(f"{source}: [composer] auto_heal must be true or false", field="composer.auto_heal")
    fabrics_doc = doc.get("fabric", [])
    if isinstance(fabrics_doc, Mapping):
        raise ConfigError(f"{source}: write each fabric as [[fabric]] (a list of tables), not [fabric]", field="fabric")
    if not isinstance(fabrics_doc, list) or not fabrics_doc:
        raise ConfigError(f"{source}: at least one [[fabric]] is needed", field="fabric")
    fabrics = []
    seen: set[str] = set()
    states: dict[tuple[str, str], str] = {}  # (option, the path it names, resolved): the fabric that gave it
    for n, fab in enumerate(fabrics_doc):
        where = f"[[fabric]] #{n + 1}"
        if not isinstance(fab, Mapping):
            raise ConfigError(f"{source}: {where} must be a table", field="fabric")
        _known(fab, {"name", "driver", "options"}, where, source, f"fabric[{n}]")
        name, driver, options = fab.get("name"), fab.get("driver"), fab.get("options", {})
        if name is None:
            raise ConfigError(
                f'{source}: {where} has no name: give it one (name = "pcie0"), 1 to {MAX_FABRIC_NAME} characters',
                field=f"fabric[{n}].name",
            )
        refused = fabric_name_refusal(name)
        if refused is not None or not isinstance(name, str):
            raise ConfigError(f"{source}: {where} needs a name: {refused}", field=f"fabric[{n}].name")
        if name in seen:
            raise ConfigError(f"{source}: two fabrics are named {name!r}", field=f"fabric[{n}].name")
        seen.add(name)
        if not isinstance(driver, str) or not driver:
            raise ConfigError(f"{source}: fabric {name!r} needs a driver", field=f"fabric[{n}].driver")
        if not isinstance(options, Mapping):
            raise ConfigError(f"{source}: options of fabric {name!r} must be a table", field=f"fabric[{n}].options")
        for key in STATE_OPTIONS:
            value = options.get(key)
            if isinstance(value, str) and value and "\0" not in value:
                other = states.setdefault((key, os.path.realpath(value)), name)
                if other != name:
                    raise ConfigError(
                        f"{source}: fabric {name!r} {key} {value!r} is fabric {other!r}'s too: each saves its "
                        "state there over the other's, losing its bindings; give each fabric its own",
                        field=f"fabric[{n}].options.{key}",
                    )
        fabrics.append(FabricConfig(name, driver, dict(options)))
    listeners: list[str] = []
    listener_docs = doc.get("listener", [])
    if not isinstance(listener_docs, list):
        raise ConfigError(f"{source}: [[listener]] must be a list of tables", field="listener")
    for n, lis in enumerate(listener_docs):
        if not isinstance(lis, Mapping) or not isinstance(lis.get("address"), str) or not lis["address"]:
            raise ConfigError(f"{source}: [[listener]] #{n + 1} needs an address", field=f"listener[{n}].address")
        _known(lis, {"address"}, f"[[listener]] #{n + 1}", source, f"listener[{n}]")
        if lis["address"] in listeners:
            raise ConfigError(
                f"{source}: [[listener]] #{n + 1} address {lis['address']!r} is "
                f"#{listeners.index(lis['address']) + 1}'s too: give each address once",
                field=f"listener[{n}].address",
            )
        listeners.append(lis["address"])
    return Config(
        fabrics=tuple(fabrics),
        ledger=ledger,
        ledger_path=str(path),
        etcd_endpoints=tuple(endpoints),
        etcd_prefix=prefix,
        lease_ttl_s=ttl,
        epoch_base=epoch_base,
        policy=policy,
        auto_heal=auto_heal,
        call_timeout_s=float(timeout),
        listeners=tuple(listeners),
        source=source,
    )


def default_document() -> dict[str, Any]:
    text = resources.files("disagg").joinpath("defaults/default.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def demo_config() -> Config:
    """The embedded default with an in-memory ledger and no state files: nothing outlives the process."""
    doc = default_document()
    doc["state"] = {"ledger": "memory"}
    for fabric in doc["fabric"]:
        fabric["options"] = {k: v for k, v in fabric.get("options", {}).items() if k != "state_file"}
    return parse_config(doc, "embedded default (in memory)")


def read_toml(path: Path, what: str, field: str = "", *, named_by: str = "") -> dict[str, Any]:
    """The TOML document in the file at ``path`` (``what`` names it in an error, as ``--options-file`` or
    "configuration file", and ``named_by`` where its path came from when the command line did not give it);
    every way it can fail to be one is a `ConfigError` saying so, never a traceback."""
    named = f"{what} {path}" + (f" (from {named_by})" if named_by else "")
    try:
        text = path.read_text(encoding="utf-8")
        # tomllib said "Invalid statement (at line 1, column 1)" of a first line that looks right
        if text.startswith("\ufeff"):
            raise ConfigError(
                f"cannot read {named}: it starts with a byte order mark (U+FEFF), which TOML does not allow: save it "
                "as UTF-8 without one",
                field=field,
            )
        return tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"{named} does not exist", field=field) from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8, whatever the locale says
        raise ConfigError(f"cannot read {named}: not UTF-8 ({exc})", field=field) from None
    except RecursionError:
        raise ConfigError(f"cannot read {named}: not valid TOML: nested too deeply", field=field) from None
    except (OSError, ValueError) as exc:  # ValueError: TOMLDecodeError, an integer of too many digits, a NUL
        raise ConfigError(f"cannot read {named}: {exc}", field=field) from None


def load_config(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """The configuration at ``path`` (``--config``), else ``$DISAGG_CONFIG`` (empty: unset), else
    ``./disagg.toml``, else the embedded default. An empty ``path`` is refused: it is most often a variable
    left unset (``--config "$CFG"``), and serving the demo rack instead would hide that."""
    env = os.environ if environ is None else environ
    if path is not None and not str(path):
        raise ConfigError(
            "--config is empty: give the configuration file's path (was it a variable left unset?), or leave "
            f"--config out to read ${CONFIG_ENV}, ./disagg.toml or the embedded default",
            field="config",
        )
    candidate = Path(path) if path else Path(env[CONFIG_ENV]) if env.get(CONFIG_ENV) else Path("disagg.toml")
    if path or env.get(CONFIG_ENV) or candidate.exists():
        # A path from the environment is said to be one: a variable left set names a file the command line did not.
        named_by = "" if path or not env.get(CONFIG_ENV) else f"${CONFIG_ENV}"
        doc = read_toml(candidate, "configuration file", named_by=named_by)
        return parse_config(doc, str(candidate), env, base=candidate.absolute().parent)
    return parse_config(default_document(), "embedded default", env)


def build_composer(config: Config, *, ledger: str | None = None, plugins: Plugins | None = None) -> FabricComposer:
    """Load plugins, create each fabric through its driver, open the ledger; the composer is not started."""
    from disagg.composer import FabricComposer
    from disagg.plugins import load_plugins
    from disagg.store import MemoryStore, SqliteStore, Store

    loaded = plugins if plugins is not None else load_plugins()
    try:
        policy = loaded.policy(config.policy)
    except PluginError as exc:
        raise ConfigError(f"{config.source}: [composer] policy: {exc.message}", field="composer.policy") from exc
    specs = []
    for n, fab in enumerate(config.fabrics):  # every driver found before any fabric is built (a QEMU started)
        try:
            specs.append(loaded.driver(fab.driver))
        except PluginError as exc:
            raise ConfigError(
                f"{config.source}: [[fabric]] #{n + 1} ({fab.name!r}) driver: {exc.message}",
                field=f"fabric[{n}].driver",
            ) from exc
    fabrics = {}
    try:
        for fab, spec in zip(config.fabrics, specs, strict=True):
            fabrics[fab.name] = spec.factory(fab.name, fab.options)
    except PluginError as exc:
        for f in fabrics.values():
            f.close()
        raise ConfigError(f"{config.source}: {exc.message}") from exc
    except ConfigError as exc:  # a driver refused an option: say which file holds it
        for f in fabrics.values():
            f.close()
        raise ConfigError(f"{config.source}: {exc.message}", field=exc.field, metadata=exc.metadata) from exc
    except BaseException:
        for f in fabrics.values():
            f.close()
        raise
    kind = ledger or config.ledger
    store: Store
    if kind == "memory":
        store = MemoryStore()
    elif kind == "etcd":
        from disagg.store import etcd
        from disagg.store.etcd import EtcdStore

        store = EtcdStore(
            config.etcd_endpoints,
            prefix=config.etcd_prefix,
            timeout_s=etcd.request_timeout(config.lease_ttl_s),
            write_patience_s=etcd.write_patience(config.lease_ttl_s),
        )
    else:
        try:
            store = SqliteStore(config.ledger_path)
        except BaseException as exc:
            for f in fabrics.values():
                f.close()
            if isinstance(exc, ConfigError) and exc.field == "state.path":  # a setting of this file: say which
                raise ConfigError(
                    f"{config.source}: [state] path: {exc.message}", field="state.path", metadata=exc.metadata
                ) from exc
            raise
    return FabricComposer(
        fabrics, policy=policy, store=store, auto_heal=config.auto_heal, call_timeout_s=config.call_timeout_s
    )
