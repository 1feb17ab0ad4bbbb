"""Plateau page."""

from kvscope.dashboard._shell import run_page
from kvscope.dashboard._views.plateau import render

run_page(render, "Plateau")
