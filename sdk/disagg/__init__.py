"""disagg: an SDK and fabric manager for composable, disaggregated AI infrastructure.

The public namespace is small: plugin authors need `hookimpl`; everything else lives in `disagg.model`,
`disagg.interfaces`, `disagg.errors` and `disagg.composer`.
"""

from importlib.metadata import PackageNotFoundError, version

import pluggy

try:
    __version__ = version("disagg")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without installing
    __version__ = "0.0.0"

hookimpl = pluggy.HookimplMarker("disagg")
"""Marks a plugin's hook implementations."""

__all__ = ["__version__", "hookimpl"]
