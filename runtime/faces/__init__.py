"""The `pdserve` command faces: one module per command, each mapping options → request → use case → render.

runtime/cli.py only assembles them into one typer app; every module here prints and exits through
runtime.faces.common (exit 0 success, 1 a failure while running, 2 bad usage or a bad value).
"""
