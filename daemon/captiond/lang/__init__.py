"""Pure text and language knowledge, any thread: words and joins in every script (`text`),
Chinese scripts (`chinese`), language tags, tasks and prompts (`languages`).
"""
