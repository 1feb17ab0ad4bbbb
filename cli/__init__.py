"""The ``kvscope`` command line: every subcommand, its argument types and start-up checks.

:mod:`kvscope.cli.main` builds the parser and dispatches; each subcommand lives in a
module of its own and imports what it needs only when it runs, so ``kvscope --help``
works with no extra installed.
"""
