"""The Hugging Face hub as a port sees it: its endpoint, whether it is reachable (a socket probe,
seconds, before any download), offline mode, and what a failed download means (gated, unreachable).
"""

from __future__ import annotations

import os
import socket
import threading

from ..errors import HubUnreachableError


def hf_token() -> str | None:
    """The Hugging Face token, from HF_TOKEN only (never from arguments that could be logged)."""
    return os.environ.get("HF_TOKEN") or None


HUB_PROBE_TIMEOUT_S = 3.0


_TRUTHY = {"1", "on", "yes", "true"}


def hub_endpoint() -> str:
    """The hub URL downloads go to (`HF_ENDPOINT`, read by huggingface_hub when it is imported)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_offline() -> bool:
    """Whether the user switched the hub off (`HF_HUB_OFFLINE` / `TRANSFORMERS_OFFLINE`)."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(f.strip().lower() in _TRUTHY for f in flags) or bool(constants.HF_HUB_OFFLINE)


def _probe_address(endpoint: str) -> tuple[str, int]:
    """(host, port) a download would connect to first: the endpoint, or its HTTPS proxy."""
    import urllib.request
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    host = url.hostname or endpoint
    port = url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme or "https")
    if proxy and not urllib.request.proxy_bypass(host):
        proxy_url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return proxy_url.hostname or host, proxy_url.port or 8080
    return host, port


def probe_hub(endpoint: str | None = None, timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the hub (or its proxy) opens within `timeout`; else why not.

    One short probe instead of huggingface_hub's retries: without network those take ~25 s per
    file and end in an error that reads like a missing token. The connection (name lookup
    included) runs in a daemon thread, so a resolver that hangs cannot hold the caller longer.
    """
    endpoint = endpoint or hub_endpoint()
    host, port = _probe_address(endpoint)
    outcome: dict[str, BaseException | bool] = {}

    def connect() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                outcome["ok"] = True
        except OSError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=connect, name="gemma4lib-hub-probe", daemon=True)
    worker.start()
    worker.join(timeout + 0.5)
    if outcome.get("ok"):
        return None
    error = outcome.get("error")
    if error is None:
        return f"no answer from {host}:{port} within {timeout:g} s"
    return f"cannot connect to {host}:{port} ({type(error).__name__}: {error})"


def _chain(exc: BaseException | None):
    """An exception and everything it was raised from."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _is_connection_error(exc: BaseException) -> bool:
    """Whether a hub failure was the network (not an answer from the hub)."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    network = (LocalEntryNotFoundError, OfflineModeIsEnabled, ConnectionError, socket.gaierror, TimeoutError)
    names = ("ConnectError", "ConnectTimeout", "NetworkError", "ProxyError")
    return any(isinstance(e, network) or type(e).__name__ in names for e in _chain(exc))


def _is_gated(exc: BaseException) -> bool:
    from huggingface_hub.errors import GatedRepoError

    return any(isinstance(e, GatedRepoError) for e in _chain(exc))


def _unreachable(checkpoint: str, reason: str) -> HubUnreachableError:
    return HubUnreachableError(
        f"cannot load {checkpoint!r} from the Hugging Face hub: {reason}, and it is not in the "
        f"local hub cache. No network (or offline mode) here: download it on a machine with access "
        f"(`hf download {checkpoint} --local-dir <folder>`), copy the folder over and point "
        f"checkpoint= at it; or set HF_ENDPOINT to a hub mirror you can reach"
    )
