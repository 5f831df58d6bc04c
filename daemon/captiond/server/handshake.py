"""websockets' Sans-I/O server protocol, made to answer the requests it would drop unanswered.

websockets serves GET only, and closes without a word when a request's head does not parse: a
HEAD or POST, HTTP/1.0, a header line over its length limit, bytes that are not HTTP. The client
then sees an empty reply and cannot tell a wrong request from a crashed daemon.
`AnsweringProtocol` first parses the head with websockets' own parser, on a copy, and answers
what fails: 405 with `Allow: GET` for another method, 400 with the parser's reason for the
rest. A head that parses goes on to websockets unchanged (server/daemon.py's `process_request`).

Runs on the event-loop thread of the process that serves the connection (a worker, with
`[server] workers` > 1).
"""

from __future__ import annotations

import dataclasses
import http
import re
from collections.abc import Callable, Generator
from typing import Any

from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.streams import StreamReader

_HEAD_END = b"\r\n\r\n"
# Past this the head is waited for no longer: websockets' parser refuses it on its own limits
# (its line length, 128 headers), and the copy is parsed as far as it goes.
_MAX_HEAD_BYTES = 128 * 1024
_METHOD = re.compile(rb"[A-Z]+")


class AnsweringProtocol(ServerProtocol):
    """`ServerProtocol` that answers a request head websockets cannot parse; `refused` is
    called with each such answer's status (server/daemon.py counts them)."""

    def __init__(self, *args: Any, refused: Callable[[int], None], **kwargs: Any) -> None:
        # Before super(): its __init__ starts the parser, which reads `_refused`.
        self._refused = refused
        super().__init__(*args, **kwargs)

    def parse(self) -> Generator[None]:
        if self.state is State.CONNECTING:
            refusal = yield from self._refusal()
            if refusal is not None:
                self._refused(refusal.status_code)
                self.send_response(refusal)
                # send_response handed the rest of the input to a discarding parser: this one
                # is never resumed (as websockets' own parse does after a failure).
                yield
        yield from super().parse()

    def _refusal(self) -> Generator[None, None, Response | None]:
        """The answer to the request head in the buffer, read without consuming it; None for a
        head that parses, or a client that left before its head was complete."""
        reader = self.reader
        while _HEAD_END not in reader.buffer and not reader.eof:
            if len(reader.buffer) >= _MAX_HEAD_BYTES:
                break
            yield
        head = bytes(reader.buffer)
        copy = StreamReader()
        copy.feed_data(head)
        copy.feed_eof()
        try:
            next(Request.parse(copy.read_line))  # the whole head is there: it never yields
        except StopIteration:
            return None
        except EOFError:
            return None  # websockets' parser waits for the rest or sees the client leave
        except Exception as exc:
            method = head.partition(b" ")[0]
            if method != b"GET" and _METHOD.fullmatch(method):
                return self._not_allowed(method.decode("ascii"))
            return self._answer(http.HTTPStatus.BAD_REQUEST, f"malformed HTTP request: {exc}\n")
        return None

    def _not_allowed(self, method: str) -> Response:
        response = self._answer(
            http.HTTPStatus.METHOD_NOT_ALLOWED,
            f"{method} is not served: captiond answers GET (its websocket endpoints, the page,"
            " /metrics, /healthz)\n",
        )
        response.headers["Allow"] = "GET"
        # A HEAD's answer has no body (RFC 9110 §9.3.2); its headers stay as they are.
        return dataclasses.replace(response, body=b"") if method == "HEAD" else response

    def _answer(self, status: http.HTTPStatus, text: str) -> Response:
        response = self.reject(status, text)
        response.headers["Server"] = "captiond"
        return response
