"""The websocket shell (event-loop thread): the Daemon, its connections, HTTP answers, access
checks, rate limits, resume and worker routing. It drives the Sans-I/O core below it (streaming,
dialects) and is the only layer that touches sockets, as websockets' `asyncio/` shell does.
"""
