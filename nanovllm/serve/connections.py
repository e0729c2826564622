"""A deadline for a connection's request headers (chapter 10).

uvicorn times out a keep-alive connection that stays idle after a response, but not one
that opens and then sends its headers slowly or never ends them (a "slowloris" client
holds a connection, a file descriptor and a task this way for as long as it likes).
``with_header_deadline(seconds)`` is uvicorn's h11 protocol with a timer: armed when the
connection opens and again after each response, disarmed once a request's headers are
complete; if it fires first, the connection is closed. (h11 also caps the headers' size:
uvicorn's ``h11_max_incomplete_event_size``, 16 KiB by default.)
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadlineProtocol(H11Protocol):
    header_timeout = 10.0  # seconds; ``with_header_deadline`` sets it
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._reading_a_request():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._reading_a_request():  # (a pipelined request may have begun already)
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _reading_a_request(self) -> bool:
        """A request's headers are complete and its response is not."""
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self._reading_a_request() and not self.transport.is_closing():
            self.transport.close()


def with_header_deadline(seconds: float) -> type[HeaderDeadlineProtocol]:
    """uvicorn's ``http`` protocol class, closing connections whose headers take longer."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": seconds})
