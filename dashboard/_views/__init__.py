"""The dashboard's pages, each a ``render(snapshot)`` function."""
