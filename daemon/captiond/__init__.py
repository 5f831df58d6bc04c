"""captiond: a streaming speech transcription daemon.

Importing the package is cheap: engines, numpy-heavy modules and the server are imported lazily
by the code that needs them.
"""

from __future__ import annotations

__version__ = "0.1.0"
PROTOCOL = "captiond.v1"
