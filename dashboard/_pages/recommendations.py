"""Recommendations page."""

from kvscope.dashboard._shell import run_page
from kvscope.dashboard._views.recommendations import render

run_page(render, "Recommendations")
