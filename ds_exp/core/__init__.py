"""What every layer uses: the errors meant for people and how a run ends (errors), files written whole or not at
all as strict JSON (files), every touch of a library's private internals (compat: a module per library, each
function importing the library it reaches into, so light callers stay light), how a wait on anything outside the
process is announced and bounded (waits), and user paths that would block or never end (user_paths).

Layer 0. May import: nothing of ds_exp.
"""
