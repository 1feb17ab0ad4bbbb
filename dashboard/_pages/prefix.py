"""Prefix and routing page."""

from kvscope.dashboard._shell import run_page
from kvscope.dashboard._views.prefix import render

run_page(render, "Prefix and routing")
