"""Recommendations page."""

from dashboard._shell import run_page
from dashboard._views.recommendations import render

run_page(render, "Recommendations")
