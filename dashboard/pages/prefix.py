"""Prefix and routing page."""

from dashboard._shell import run_page
from dashboard._views.prefix import render

run_page(render, "Prefix and routing")
