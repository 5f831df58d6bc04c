"""A stream's decode requests to the engine thread and back: in process (`scheduler`, behind the
speech `gate`), or across the worker link (`client` in a worker, `link` framing, `core` in the
main process), as vLLM v1's engine core and core client. Never imports `streaming`.
"""
