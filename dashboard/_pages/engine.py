"""Engine detail page."""

from kvscope.dashboard._shell import run_page
from kvscope.dashboard._views.engine import render

run_page(render, "Engine detail")
