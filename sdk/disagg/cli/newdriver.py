"""``disagg new-driver NAME``: write a new driver plugin package that installs and certifies as written.

The package is rendered from the templates in ``disagg/templates/driver``: plain files in which ``{{key}}``
stands for a value of `_values`. The substitution is deliberately that simple (no ``str.format``, no
template engine) because the templates are Python and TOML full of braces of their own. Every file is
rendered before any is written, so a template problem leaves nothing behind.

The generated fabric is an in-memory stand-in for hardware that already keeps the whole driver contract;
``docs/driver-tutorial.md`` walks from it to a real driver.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Mapping
from importlib import metadata, resources
from pathlib import Path

from disagg import __version__
from disagg.errors import ConfigError, ConflictError, InvalidRequestError, PluginError
from disagg.plugins import DISABLE_ENV, ENTRY_POINT_GROUP, Plugins, load_plugins

DRIVER_NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
"""The rule `DriverRegistry.add_driver` enforces, checked here before anything is written."""

TEMPLATES = "templates/driver"
"""Where the templates live inside the ``disagg`` package."""

FILES: tuple[tuple[str, str], ...] = (
    ("pyproject.toml.tmpl", "pyproject.toml"),
    ("README.md.tmpl", "README.md"),
    ("__init__.py.tmpl", "src/{{package}}/__init__.py"),
    ("plugin.py.tmpl", "src/{{package}}/plugin.py"),
    ("fabric.py.tmpl", "src/{{package}}/fabric.py"),
    ("py.typed.tmpl", "src/{{package}}/py.typed"),
    ("conftest.py.tmpl", "tests/conftest.py"),
    ("test_conformance.py.tmpl", "tests/test_conformance.py"),
)
"""Each template and the path, relative to the package folder, that it is rendered to."""

_PLACEHOLDER = re.compile(r"\{\{([a-z_]+)\}\}")


def check_name(name: str) -> str:
    """``name`` if it can name a driver and its package; raises `InvalidRequestError` saying what a name may be.
    Beyond the registry's rule, a dash stands between two letters or digits: the distribution is disagg-NAME,
    which packaging refuses with a trailing dash, and a run of dashes folds into one (a--b would install over
    a-b)."""
    if not DRIVER_NAME.match(name) or name.endswith("-") or "--" in name:
        raise InvalidRequestError(
            f"{name!r} is not a valid driver name: use 1 to 63 lower-case letters, digits and dashes, "
            "starting with a letter, each dash between two letters or digits (for example acme or acme-cxl)",
            field="name",
        )
    return name


def _values(name: str) -> dict[str, str]:
    """What the placeholders stand for: ``acme-cxl`` gives package ``disagg_acme_cxl``, class ``AcmeCxl``."""
    return {
        "name": name,
        "package": "disagg_" + name.replace("-", "_"),
        "class": "".join(part.capitalize() for part in name.split("-")),
        "disagg_version": __version__,
    }


def render(text: str, values: Mapping[str, str]) -> str:
    """``text`` with every ``{{key}}`` replaced; an unknown key is a bug in a template, so it raises KeyError."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def render_package(name: str) -> dict[str, str]:
    """The files of the package for driver ``name``: relative path to content."""
    values = _values(check_name(name))
    root = resources.files("disagg").joinpath(TEMPLATES)
    return {
        render(target, values): render(root.joinpath(template).read_text(encoding="utf-8"), values)
        for template, target in FILES
    }


def _check_free(name: str) -> None:
    """Refuse a name that an installed plugin registers, or that an installed package holds: two plugins with
    one driver name make every later `load_plugins` fail, which would take the whole installation down, not only
    the new driver, and installing a second disagg-NAME replaces the first. A plugin that is blocked
    (DISAGG_DISABLE_PLUGINS) or fails to load registers nothing now but holds its name all the same, so the
    installed metadata is read too, without loading anything. Plugins that make the loading fail are no reason
    to refuse writing a package: then only the metadata is checked."""
    try:
        plugins: Plugins | None = load_plugins()
    except PluginError:
        plugins = None
    spec = plugins.drivers.get(name) if plugins is not None else None
    if spec is not None:
        raise ConflictError(f"driver name {name!r} is taken: plugin {spec.plugin!r} registers it; choose another name")
    holder = _installed_holder(name, plugins)
    if holder:
        raise ConflictError(f"driver name {name!r} is taken: {holder}; choose another name")


def _installed_holder(name: str, plugins: Plugins | None) -> str:
    """What installed package holds ``name`` though no loaded plugin registers it: an entry point ``name`` in
    the drivers' group (with why it registers nothing now, when the loading says), or the distribution
    disagg-NAME that the new package would be; empty when there is none."""
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP, name=name):
        of = f" of {ep.dist.name} {ep.dist.version}" if ep.dist is not None else ""
        why = ""
        if plugins is not None and name in plugins.blocked:
            why = f", blocked by {DISABLE_ENV}"
        elif plugins is not None and name in plugins.broken:
            why = f", which failed to load ({plugins.broken[name]})"
        return f"the entry point {name} = {ep.value}{of} is installed in the group {ENTRY_POINT_GROUP!r}{why}"
    try:
        dist = metadata.distribution(f"disagg-{name}")
    except metadata.PackageNotFoundError:
        return ""
    return f"the distribution {dist.metadata['Name']} {dist.version} is installed"


def _check_target(target: Path) -> None:
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{target} exists and is not a folder", field="dir")
    if target.is_dir() and any(target.iterdir()):
        raise ConfigError(
            f"{target} is not empty; give --dir a new or empty folder so that nothing is overwritten", field="dir"
        )


def write_package(name: str, target: Path) -> list[Path]:
    """Write the package for driver ``name`` into ``target`` (new or empty); the paths written, in order."""
    files = render_package(name)
    _check_target(target)
    written = []
    try:
        for relative, content in files.items():
            path = target / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8")
            written.append(path)
    except OSError as exc:
        raise ConfigError(f"cannot write the driver package into {target}: {exc}", field="dir") from None
    return written


def cmd_new_driver(args: argparse.Namespace) -> int:
    name = check_name(args.name)
    if args.dir == "":  # most often ``--dir "$DIR"`` with DIR unset: ./disagg-NAME is a folder it never named
        raise ConfigError(
            f"--dir is empty: give the folder to write into (was it a variable left unset?), or leave --dir out to "
            f"write into ./disagg-{name}",
            field="dir",
        )
    target = Path(args.dir) if args.dir is not None else Path(f"disagg-{name}")
    _check_target(target)
    _check_free(name)
    write_package(name, target)
    package = _values(name)["package"]
    steps = (
        (f"cd {shlex.quote(str(target))}", ""),
        ("pip install -e '.[test]'", "registers the driver through its entry point"),
        ("pytest", "runs the conformance suite against it"),
        (f"disagg certify {name}", "the same suite; writes certification/ (json, xml, md)"),
    )
    width = max(len(command) for command, _ in steps)
    print(f"wrote driver {name} (package {package}) into {target}; next:")
    for command, why in steps:
        print(f"  {command.ljust(width)}  # {why}" if why else f"  {command}")
    print(f"then replace the in-memory parts marked TODO in src/{package}/fabric.py (see docs/driver-tutorial.md)")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``new-driver`` to the subcommands of the ``disagg`` parser."""
    about = (
        "write a new driver plugin package: an in-memory fabric that keeps the driver contract, its entry point, "
        "and a test module that runs the conformance suite"
    )
    p = sub.add_parser("new-driver", help=about, description=about)
    p.add_argument("name", metavar="NAME", help="the driver name: lower-case letters, digits and dashes")
    p.add_argument("--dir", metavar="PATH", help="a new or empty folder to write into (default: ./disagg-NAME)")
    p.set_defaults(func=cmd_new_driver)
