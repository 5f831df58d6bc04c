"""The browser client's static files (index.html, JS modules, CSS), served by the daemon at "/".

A package only so that the files ship as package data; `captiond.server.http` reads them.
"""
