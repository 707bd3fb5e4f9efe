"""What the processes say to people: error messages that name many things in a line
(:mod:`~protocol.text.wording`), a user's traceback as they read it
(:mod:`~protocol.text.user_tracebacks`, with :mod:`~protocol.text.code_owners`: whose code a
frame is), sizes and durations as a person writes them (:mod:`~protocol.text.quantities`), and
one log line per record (:mod:`~protocol.text.log_lines`). No I/O.
"""
