"""The transcript journal: `writer` appends a session's finals (event-loop thread), `reader`
reads them back for resume, `captiond journal` and the viewers.
"""
