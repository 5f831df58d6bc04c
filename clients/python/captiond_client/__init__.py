"""captiond_client: stream audio to a captiond daemon and show its captions."""

from __future__ import annotations

DEFAULT_URL = "ws://127.0.0.1:8765/v1/stream"
