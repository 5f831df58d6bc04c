"""The Sans-I/O core: one stream, from PCM bytes to caption events (its message values in
`events`). Each StreamSession is owned by the thread that feeds it, the event loop's in the
daemon; nothing here does I/O or reads the wall clock.
"""
