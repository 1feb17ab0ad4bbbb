"""Engine detail page."""

from dashboard._shell import run_page
from dashboard._views.engine import render

run_page(render, "Engine detail")
