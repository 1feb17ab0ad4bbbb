"""Plateau page."""

from dashboard._shell import run_page
from dashboard._views.plateau import render

run_page(render, "Plateau")
