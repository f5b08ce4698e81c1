"""A small client of the REST API for the CLI: where the API is, which token, error messages.

The token comes from `--token`, then `POLYTRAIN_TOKEN`, then what `polytrain login`
saved (in `POLYTRAIN_CONFIG`, default `~/.config/polytrain/credentials.json`, mode 0600).
"""

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class ClientError(Exception):
    """The API refused a request (its message), or could not be reached."""


def config_path() -> Path:
    return Path(
        os.environ.get("POLYTRAIN_CONFIG")
        or Path.home() / ".config" / "polytrain" / "credentials.json"
    )


def load_credentials() -> dict[str, str]:
    path = config_path()
    return json.loads(path.read_text()) if path.is_file() else {}


def save_credentials(api_url: str, token: str, email: str) -> Path:
    """Keep the token for later commands, readable by this user only."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"api_url": api_url, "token": token, "email": email}, fh)
    return path


def forget_credentials() -> None:
    config_path().unlink(missing_ok=True)


def error_message(response: httpx.Response) -> str:
    """The `error.message` of the API's error shape, or the raw text."""
    try:
        error = response.json()["error"]
        field = f" (field {error['field']})" if error.get("field") else ""
        return f"{error['message']}{field}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:500]}"


@dataclass
class Api:
    """The REST API at `url`, called with `token`."""

    url: str
    token: str | None

    @classmethod
    def resolve(cls, url: str | None = None, token: str | None = None) -> "Api":
        saved = load_credentials()
        return cls(
            url=(
                url or os.environ.get("POLYTRAIN_API_URL") or saved.get("api_url") or DEFAULT_URL
            ).rstrip("/"),
            token=token or os.environ.get("POLYTRAIN_TOKEN") or saved.get("token"),
        )

    def client(self, timeout: float | None = 30) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.url + "/api/v1", headers=headers, timeout=timeout)

    def response(
        self, method: str, path: str, *, timeout: float = 30, **kwargs: Any
    ) -> httpx.Response:
        """One request, answered within `timeout` seconds, its status checked.

        Raises:
            ClientError: refused (the API's message), or the API cannot be reached.
        """
        try:
            with self.client(timeout=timeout) as client:
                response = client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ClientError(f"cannot reach the API at {self.url}: {exc}") from exc
        if response.status_code >= 400:
            raise ClientError(error_message(response))
        return response

    def call(self, method: str, path: str, *, timeout: float = 30, **kwargs: Any) -> Any:
        """One request, answered within `timeout` seconds; the decoded JSON answer (None for
        204). Raises ClientError."""
        response = self.response(method, path, timeout=timeout, **kwargs)
        return None if response.status_code == 204 else response.json()

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.call("GET", path, **kwargs)

    def listing(self, path: str, params: dict[str, Any]) -> tuple[list[Any], int]:
        """One page of a paged list (`offset`, `limit` in `params`) and the list's whole
        length, from the API's `X-Total-Count` header. Raises ClientError."""
        response = self.response("GET", path, params=params)
        rows = response.json()
        return rows, int(response.headers.get("X-Total-Count", len(rows)))

    def post(self, path: str, **kwargs: Any) -> Any:
        return self.call("POST", path, **kwargs)

    @contextlib.contextmanager
    def _opened(
        self, path: str, *, timeout: float | None, what: str, **kwargs: Any
    ) -> Iterator[httpx.Response]:
        """`GET path` opened as a stream, its status checked; `what` names the transfer in a
        connection error.

        Raises:
            ClientError: refused (before any of the body), or the connection failed.
        """
        try:
            with (
                self.client(timeout=timeout) as client,
                client.stream("GET", path, **kwargs) as response,
            ):
                if response.status_code >= 400:
                    response.read()
                    raise ClientError(error_message(response))
                yield response
        except httpx.TransportError as exc:
            raise ClientError(f"{what} interrupted: {exc}") from exc

    def stream(
        self, path: str, *, params: dict[str, Any] | None = None, timeout: float = 60
    ) -> Iterator[bytes]:
        """The body of `GET path` in chunks as they arrive (each within `timeout` seconds).

        Raises:
            ClientError: refused (before any chunk), or the connection failed.
        """
        with self._opened(path, timeout=timeout, what="download", params=params) as response:
            yield from response.iter_bytes()

    def events(self, path: str, last_id: int = 0) -> Iterator[tuple[str, dict[str, Any], int]]:
        """Server-sent events of `path` as `(event, data, id)`, resuming after `last_id`.

        Raises:
            ClientError: refused, or the connection failed.
        """
        headers = {"Last-Event-ID": str(last_id)} if last_id else {}
        with self._opened(path, timeout=None, what="log stream", headers=headers) as response:
            yield from _parse_events(response.iter_lines())


def _parse_events(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any], int]]:
    event, data, event_id = "message", "", 0
    for line in lines:
        if not line:
            if data:
                yield event, json.loads(data), event_id
            event, data = "message", ""
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif line.startswith("id:"):
            event_id = int(line[3:].strip() or 0)
