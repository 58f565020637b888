"""Is a server there? One quick HTTP request, so a run fails in seconds instead of retrying for minutes.
And which port is free, for a server posttrain will start.

MLflow's client retries a refused connection with backoff for minutes, and Prefect's client
likewise; a run that only finds out inside its first logging call has already taken the store's
lock and started work. :func:`unreachable` asks once, with a short timeout, before any of that.
"""

from __future__ import annotations

import socket
import ssl
import urllib.error
import urllib.request

from posttrain.core.redact import redact_text

__all__ = ["PREFLIGHT_TIMEOUT_S", "free_port", "tcp_unreachable", "unreachable"]

PREFLIGHT_TIMEOUT_S = 4.0
"""Per request; the CLI makes at most two (MLflow, Prefect), so it fails within ten seconds."""


def unreachable(
    url: str, timeout: float = PREFLIGHT_TIMEOUT_S, context: ssl.SSLContext | None = None
) -> str | None:
    """Why ``url`` cannot be reached (refused, timed out, unknown host), or None if it answered.

    Any HTTP answer counts as reachable (an auth error or a 404 is the server talking); only
    transport failures are reported.

    >>> unreachable("http://127.0.0.1:9/health", timeout=1.0)
    'http://127.0.0.1:9/health: connection refused'
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context):  # noqa: S310 - http(s) only
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ConnectionRefusedError):
            why = "connection refused"
        elif isinstance(reason, socket.timeout | TimeoutError):
            why = f"no answer within {timeout:g} s"
        elif isinstance(reason, socket.gaierror):
            why = "unknown host"
        else:
            why = str(reason)
        return f"{redact_text(url)}: {why}"
    except TimeoutError:
        return f"{redact_text(url)}: no answer within {timeout:g} s"
    except (OSError, ValueError) as exc:
        return f"{redact_text(url)}: {exc}"


def tcp_unreachable(host: str, port: int, timeout: float = PREFLIGHT_TIMEOUT_S) -> str | None:
    """Why nothing accepts a TCP connection at ``host:port`` within ``timeout`` (None: something
    does): the check for a database server, which speaks no HTTP.

    >>> tcp_unreachable("127.0.0.1", 9, timeout=1.0)
    '127.0.0.1:9: connection refused'
    """
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        why = "connection refused"
    except TimeoutError:
        why = f"no answer within {timeout:g} s"
    except socket.gaierror:
        why = "unknown host"
    except OSError as exc:
        why = exc.strerror or str(exc)
    return f"{host}:{port}: {why}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` now, as the kernel picks one for port 0.

    The socket is closed before the port is used, so another process could take it in between;
    the kernel hands out ephemeral ports in turn, which makes that rare.

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
