"""A Python client of the fabric-manager protocol (``disagg.fabric.v1.FabricManagerService``).

It takes and returns the model (`Composition`, `Device`, `Event`, ...) and raises the SDK's errors, rebuilt
from the server's error details, so that ``except NoFitError`` works as it does in process::

    with FabricManagerClient("unix:/run/disagg.sock") as fm:
        result = fm.compose(parse_request("job", ["gpu x2 model=H200"]))
"""

from disagg.client._client import MAX_TIMEOUT_S, DeviceStatus, EventStream, FabricInfo, FabricManagerClient
from disagg.client._retry import NO_RETRY, RETRYABLE_CODES, RetryPolicy, may_retry

__all__ = [
    "MAX_TIMEOUT_S",
    "NO_RETRY",
    "RETRYABLE_CODES",
    "DeviceStatus",
    "EventStream",
    "FabricInfo",
    "FabricManagerClient",
    "RetryPolicy",
    "may_retry",
]
