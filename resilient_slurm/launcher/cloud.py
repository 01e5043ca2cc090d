"""Cloud termination notices: poll the instance metadata service and report the announced end once.

Who calls what, and when: the launcher creates one ``TerminationNoticeWatcher`` per node at start,
``start()``s it, and ``stop()``s it at teardown. The watcher's daemon thread polls every ``interval``
seconds and calls ``on_notice(Notice)`` exactly once, from that thread, then stops polling. ``on_notice``
must only set a flag (like a signal handler): the launcher's main loop does the saving.

Endpoints (``kind``):

* ``aws``: ``/latest/meta-data/spot/instance-action``; 404 = no notice, 200 with
  ``{"action": "terminate"|"stop"|"hibernate", "time": ISO8601}`` = notice with a deadline. IMDSv2 first
  (``PUT /latest/api/token``, then the token header), IMDSv1 when the token request fails.
  A 200 whose body is not the documented JSON still counts as a notice (action ``"unknown"``, no
  deadline): the path answers 200 only when an action is scheduled, and acting on a false notice costs an
  early checkpoint while ignoring a true one costs the work since the last checkpoint.
* ``gce``: ``/computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``; body ``TRUE`` =
  notice (GCE gives about 30 s but no time, so no deadline), ``FALSE`` = none; any other body is logged
  and is not a notice (a 200 is the normal answer there, so it carries no meaning by itself).
* ``generic``: any 200 from ``url`` is a notice (no deadline); anything else is not.

Connection errors, timeouts and unexpected statuses are logged (one warning per kind of failure per
``log_every`` seconds, the rest at debug level) and polling goes on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import urlsplit, urlunsplit

import requests

from ..errors import ConfigError

logger = logging.getLogger(__name__)

KINDS = ("aws", "gce", "generic")
DEFAULT_URLS = {
    "aws": "http://169.254.169.254/latest/meta-data/spot/instance-action",
    "gce": "http://metadata.google.internal/computeMetadata/v1/instance/preempted",
}
AWS_TOKEN_PATH = "/latest/api/token"
AWS_TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"
GCE_HEADERS = {"Metadata-Flavor": "Google"}


@dataclass(frozen=True)
class Notice:
    """An announced end of this instance: ``kind`` of endpoint, ``action`` (``terminate``, ``stop``,
    ``hibernate``, ``preempted``, ``notice``, ``unknown``), ``deadline_epoch`` (None when not announced)
    and the ``raw`` response body."""

    kind: str
    action: str
    deadline_epoch: float | None
    raw: str


class _RateLimitedLog:
    """One warning per key per ``every`` seconds; repeats in between go to debug, and are counted."""

    def __init__(self, every: float, clock: Callable[[], float]) -> None:
        self.every = every
        self.clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        """Warn about ``key`` unless it was warned about less than ``every`` seconds ago."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            logger.debug(msg, *args)
            return
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        suffix = f" ({n} similar messages suppressed)" if n else ""
        logger.warning(msg + suffix, *args)


class TerminationNoticeWatcher:
    """Poll a metadata endpoint in a daemon thread; call ``on_notice`` once when a termination is announced.

    ``url``: the endpoint (None: the default for ``kind``; ``generic`` needs one). ``session``: a
    ``requests.Session`` (default: one that ignores proxy environment variables). ``clock``: monotonic
    seconds, for log rate limiting and the IMDSv2 token lifetime. ``sleep``: waits between polls; the
    default waits on the stop event so ``stop()`` is prompt, an injected one delays ``stop()`` by up to
    one call. ``timeout``: seconds per HTTP request, so one poll never hangs.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        kind: str = "aws",
        interval: float = 5.0,
        on_notice: Callable[[Notice], object],
        session: requests.Session | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] | None = None,
        timeout: float = 2.0,
        token_ttl: int = 21600,
        log_every: float = 60.0,
    ) -> None:
        if kind not in KINDS:
            raise ConfigError(f"cloud notice kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if url is None:
            if kind not in DEFAULT_URLS:
                raise ConfigError(f"cloud notice kind {kind!r} needs a url (RSLURM_CLOUD_NOTICE_URL)")
            url = DEFAULT_URLS[kind]
        if urlsplit(url).scheme not in ("http", "https"):
            raise ConfigError(f"cloud notice url must be http:// or https://, got {url!r}")
        if interval <= 0:
            raise ConfigError(f"cloud notice interval must be > 0 seconds, got {interval}")
        if timeout <= 0:
            raise ConfigError(f"cloud notice timeout must be > 0 seconds, got {timeout}")
        self.url = url
        self.kind = kind
        self.interval = interval
        self.timeout = timeout
        self.token_ttl = token_ttl
        self.on_notice = on_notice
        self.clock = clock
        if session is None:
            session = requests.Session()
            # Metadata endpoints are link-local: an HTTP(S)_PROXY from the job's environment would send
            # the query to a proxy that cannot reach them (or leak it).
            session.trust_env = False
        self.session = session
        self._stop = threading.Event()
        self._sleep = sleep if sleep is not None else self._stop.wait
        self._log = _RateLimitedLog(log_every, clock)
        self._thread: threading.Thread | None = None
        self._fired = threading.Lock()
        self._token: str | None = None
        self._token_expires = 0.0
        self.notice: Notice | None = None
        self.polls = 0
        self.errors = 0

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> TerminationNoticeWatcher:
        """Start the polling thread (once)."""
        if self._thread is not None:
            raise RuntimeError("TerminationNoticeWatcher.start() called twice")
        self._thread = threading.Thread(target=self._run, name=f"rslurm-{self.kind}-notice", daemon=True)
        self._thread.start()
        return self

    def stop(self, join_timeout: float | None = None) -> None:
        """Stop polling and wait for the thread (a request in flight ends within ``timeout``)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            # Worst case one poll is four requests (IMDSv2 token, GET, token again after a 401, GET).
            t.join(self.timeout * 4 + 1.0 if join_timeout is None else join_timeout)

    def is_alive(self) -> bool:
        """The polling thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> TerminationNoticeWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            notice = self.poll_once()
            if notice is not None:
                self._fire(notice)
                return  # one notice per instance: nothing more to learn
            if self._stop.is_set():
                return
            self._sleep(self.interval)

    def _fire(self, notice: Notice) -> None:
        if not self._fired.acquire(blocking=False):
            return
        self.notice = notice
        logger.warning("cloud termination notice (%s): action=%s deadline=%s", notice.kind, notice.action,
                       notice.deadline_epoch)
        try:
            self.on_notice(notice)
        except Exception:
            # The callback belongs to the launcher; a bug there must not go unseen, nor kill polling
            # silently (the thread ends here anyway).
            logger.exception("on_notice callback failed for %s", notice)

    # -- one poll --------------------------------------------------------------------------------------

    def poll_once(self) -> Notice | None:
        """Query the endpoint once: the notice, or None (no notice, or the query failed and was logged).

        Not thread-safe with the polling thread; call it only when the thread is not running.
        """
        self.polls += 1
        try:
            if self.kind == "aws":
                return self._poll_aws()
            if self.kind == "gce":
                return self._poll_gce()
            return self._poll_generic()
        except requests.RequestException as exc:
            self.errors += 1
            self._log.warning(f"error:{type(exc).__name__}", "cloud notice poll of %s failed: %s: %s",
                              self.url, type(exc).__name__, exc)
            return None

    def _get(self, headers: dict[str, str] | None = None) -> requests.Response:
        return self.session.get(self.url, headers=headers, timeout=self.timeout, allow_redirects=False)

    def _unexpected(self, resp: requests.Response) -> None:
        self.errors += 1
        self._log.warning(f"status:{resp.status_code}", "cloud notice poll of %s: unexpected HTTP %s: %r",
                          self.url, resp.status_code, resp.text[:200])

    def _poll_generic(self) -> Notice | None:
        resp = self._get()
        if resp.status_code == 200:
            return Notice(self.kind, "notice", None, resp.text)
        if resp.status_code not in (404, 204):
            self._unexpected(resp)
        return None

    def _poll_gce(self) -> Notice | None:
        resp = self._get(GCE_HEADERS)
        if resp.status_code != 200:
            self._unexpected(resp)
            return None
        body = resp.text.strip().upper()
        if body == "TRUE":
            return Notice(self.kind, "preempted", None, resp.text)
        if body != "FALSE":
            self.errors += 1
            self._log.warning("gce:body", "cloud notice poll of %s: unexpected body %r (want TRUE/FALSE)",
                              self.url, resp.text[:200])
        return None

    def _poll_aws(self) -> Notice | None:
        token = self._aws_token()
        resp = self._get({AWS_TOKEN_HEADER: token} if token else None)
        if resp.status_code == 401 and token:
            # The token expired or the service restarted: fetch a fresh one and ask again right away.
            self._token = None
            token = self._aws_token()
            resp = self._get({AWS_TOKEN_HEADER: token} if token else None)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            self._unexpected(resp)
            return None
        return self._parse_aws(resp.text)

    def _aws_token(self) -> str | None:
        """An IMDSv2 session token (cached until shortly before it expires), or None to use IMDSv1."""
        now = self.clock()
        if self._token is not None and now < self._token_expires:
            return self._token
        parts = urlsplit(self.url)
        token_url = urlunsplit((parts.scheme, parts.netloc, AWS_TOKEN_PATH, "", ""))
        try:
            resp = self.session.put(token_url, headers={AWS_TOKEN_TTL_HEADER: str(self.token_ttl)},
                                    timeout=self.timeout, allow_redirects=False)
        except requests.RequestException as exc:
            # In a container the PUT can time out while GETs work (IMDSv2 hop limit 1): try IMDSv1.
            self._log.warning("aws:token", "IMDSv2 token request to %s failed (%s); using IMDSv1",
                              token_url, type(exc).__name__)
            return None
        if resp.status_code != 200 or not resp.text.strip():
            self._log.warning("aws:token", "IMDSv2 token request to %s answered HTTP %s; using IMDSv1",
                              token_url, resp.status_code)
            return None
        self._token = resp.text.strip()
        # Renew well before expiry so a poll never presents a token that dies in flight.
        self._token_expires = now + max(1.0, self.token_ttl * 0.8)
        return self._token

    def _parse_aws(self, body: str) -> Notice:
        try:
            doc = json.loads(body)
            if not isinstance(doc, dict):
                raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
        except ValueError as exc:
            self._log.warning("aws:body", "spot instance-action at %s is not the documented JSON (%s): %r; "
                              "treating it as a notice without deadline", self.url, exc, body[:200])
            return Notice(self.kind, "unknown", None, body)
        action = str(doc.get("action") or "unknown")
        return Notice(self.kind, action, _parse_time(doc.get("time"), self.url), body)


def _parse_time(value: object, url: str) -> float | None:
    """Epoch seconds of an ISO 8601 time (``2017-09-18T08:22:00Z``); None (logged) when unparsable."""
    if not isinstance(value, str):
        logger.warning("spot instance-action at %s has no usable 'time' (%r); no deadline", url, value)
        return None
    try:
        # fromisoformat accepts "Z" only from Python 3.11.
        dt = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        logger.warning("spot instance-action at %s: unparsable 'time' %r; no deadline", url, value)
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)  # AWS times are UTC
    return dt.timestamp()


__all__ = ["DEFAULT_URLS", "KINDS", "Notice", "TerminationNoticeWatcher"]
