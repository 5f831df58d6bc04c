"""Daemon-side inputs: a device captured in its own process (`capture`, `mic`), a StreamSession
fed from it (`daemon`), its captions broadcast to viewers (`broadcast`), and audio files read
with PyAV (`audiofile`).
"""
